"""The live environments of tests/envmanager, for the attacks that step real envs."""

from tests.envmanager.conftest import desktop_env, miniwob_env

__all__ = ["desktop_env", "miniwob_env"]
