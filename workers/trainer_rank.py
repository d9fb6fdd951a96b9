"""One trainer replica of a run whose replicas span hosts, started by its host's agent
(`hostagent.agent.trainer_rank_specs`) with torchrun's environment (MASTER_ADDR, MASTER_PORT,
RANK, LOCAL_RANK, WORLD_SIZE) and DARTBOARD_RUN_ID:

    python -m workers.trainer_rank

It joins the group its leader (rank 0, in the run's train worker) forms at the rendezvous
(`training.replica_group.join`): the trainer's settings come from the leader's store, the
run's newest version from this host's copy of the run's directory (fetched from the
artifact store first) and the start policy from this host's checkpoint roots. It exits when
the group ends (the run paused or stopped, a failed update, the leader's host lost); its
agent starts it again, to join the next group the leader forms.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dartboard.settings")
    import django

    django.setup()
    # Django's models and settings import only once it is set up.
    import torch
    from django.conf import settings
    from django.db import connections

    from datamanager.models import Run
    from datamanager.policies import policy_path
    from training.replica_group import TrainerSpec, join
    from workers.artifacts import checkpoint_restore

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    run_id = int(os.environ["DARTBOARD_RUN_ID"])
    torch.set_num_threads(settings.DARTBOARD_TORCH_THREADS)

    def here(spec: TrainerSpec) -> TrainerSpec:
        """The leader's spec with this host's paths: the run's directory under this host's
        checkpoint root, its newest version fetched there, the policy from this host's roots."""
        run = Run.objects.get(pk=run_id)
        run_dir = settings.CHECKPOINT_ROOT / f"run-{run_id}"
        checkpoint_restore(run=run, run_dir=run_dir)
        start = policy_path(run.cfg.policy)
        connections.close_all()  # the group may last for days without the database
        return dataclasses.replace(spec, run_dir=str(run_dir), start_checkpoint=str(start))

    logging.getLogger("dartboard.trainer").info(
        "run %s: trainer rank %s of %s joins %s:%s",
        run_id,
        os.environ["RANK"],
        os.environ["WORLD_SIZE"],
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )
    join(spec_for=here)


if __name__ == "__main__":
    main()
    # As the one-host followers do (`training.replica_group`): leave without the
    # interpreter's teardown once the group is left.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
