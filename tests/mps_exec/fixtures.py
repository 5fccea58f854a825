"""The session fixtures every executed-host test module uses: import them by
name (`from mps_exec.fixtures import built, emu, host`) so pytest sees them."""
import pytest

from . import SHADER, require_build, session_host


@pytest.fixture(scope="session")
def built():
    return require_build()


@pytest.fixture(scope="session")
def emu():
    """The emulator's default build of the shipped shaders (tests/shader_builds.py: the wide decode
    left out but named, source_kernel_names)."""
    from shader_builds import shipped_library

    return shipped_library(path=SHADER)


@pytest.fixture(scope="session")
def host(built, emu, tmp_path_factory):
    """The host loaded into this process (once per process, shared with the other test modules), from a
    package look-alike with a fresh fake metallib."""
    return session_host(built, emu, str(tmp_path_factory.mktemp("mps_exec_pkg")))
