"""Run configs validate every field and name the exact path of a bad value."""

import pytest

from datamanager.config import ConfigError, CurationConfig, RunConfig, TrainerConfig


def test_defaults_resolve_and_round_trip():
    cfg = RunConfig.from_dict({"trainer": {"lr": 3e-4}})
    assert cfg.trainer.lr == 3e-4
    assert cfg.curation.entropy_top_q == 0.8 and cfg.curation.is_cap == 1.0
    assert cfg.trainer.clip_low == 0.2 and cfg.trainer.clip_high == 0.28
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("data", "path", "text"),
    [
        ({"trainer": {"lr": 0}}, "trainer.lr", "must be > 0"),
        ({"trainer": {"lr": "fast"}}, "trainer.lr", "must be a number"),
        ({"curation": {"entropy_top_q": 1.5}}, "curation.entropy_top_q", "(0, 1]"),
        ({"curation": {"n_min": 9, "n_max": 8}}, "curation.n_min", "n_min <= n_max"),
        ({"mode": "sync"}, "mode", "one of decoupled, synchronous"),
        (
            {"env": {"miniwob_slots": 0, "desktop_slots": 0}},
            "env.miniwob_slots",
            "at least one slot",
        ),
        ({"tasks": {"env_kinds": ["android"]}}, "tasks.env_kinds", "unknown backend"),
        ({"trainer": {"optimiser": "sgd"}}, "trainer.optimiser", "unknown setting"),
        ({"curation": {"dynamic_budget": "yes"}}, "curation.dynamic_budget", "true or false"),
        ({"env": {"osworld_addresses": ["10.0.0.5"]}}, "env.osworld_addresses", "host:port"),
        (
            {"env": {"osworld_addresses": ["t0k@10.0.0.5:5000"]}},
            "env.osworld_addresses",
            "host:port",
        ),
        (
            {"env": {"osworld_addresses": ["a:1", "a:1"]}},
            "env.osworld_addresses",
            "appears twice",
        ),
        (
            {"env": {"osworld_addresses": ["a:1"], "osworld_provider": "qemu"}},
            "env.osworld_provider",
            "unknown provider",
        ),
        (
            {"env": {"osworld_addresses": ["a:1", "b:1"], "osworld_provider": "vmware"}},
            "env.osworld_vm_paths",
            "one VM path per address (2)",
        ),
        ({"env": {"osworld_vm_paths": ["/vms/a.vmx"]}}, "env.osworld_vm_paths", "no effect"),
    ],
)
def test_bad_values_name_their_field(data, path, text):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(data)
    assert err.value.path == path
    assert text in str(err.value)


def test_osworld_vms_are_slots_of_their_own():
    cfg = RunConfig.from_dict(
        {"env": {"miniwob_slots": 0, "osworld_addresses": ["10.0.0.5:5000", "10.0.0.6:5000"]}}
    )
    assert cfg.env.slots() == [("osworld", 0), ("osworld", 1)]


@pytest.mark.parametrize(
    ("section", "name", "value"),
    [
        ("trainer", "lr", -1.0),
        ("trainer", "clip_low", 1.5),
        ("trainer", "clip_high", 0.0),
        ("trainer", "kl_coef", -0.5),
        ("trainer", "micro_batch", 0),
        ("trainer", "grad_clip", 0.0),
        ("trainer", "loss_type", "grpo"),
        ("trainer", "loss_aggregation", "seq"),
        ("curation", "entropy_top_q", 1.5),
        ("curation", "is_cap", 0.0),
    ],
)
def test_a_knob_the_update_takes_is_refused_alike_in_the_form_and_in_code(section, name, value):
    """One check per knob (training.config): the run form and the trainer's settings built
    in code (a test, a benchmark) refuse a bad value in the same words, under its own name."""
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({section: {name: value}})
    assert err.value.path == f"{section}.{name}"
    built = TrainerConfig if section == "trainer" else CurationConfig
    with pytest.raises(ConfigError) as in_code:
        built(**{name: value})
    assert (in_code.value.path, in_code.value.message) == (name, err.value.message)
