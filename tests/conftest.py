import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
pytest.register_assert_rewrite("bench_script")  # its checks report like a test's own asserts
from support import damageable_copy, speech_like_wave  # noqa: E402
# Kyutai's moshi package, the Moshi oracle, lives beside the venv's packages (dev/setup.sh says why)
sys.path.append(str(Path(sys.prefix) / "oracles"))
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
# Decode steps run eagerly unless a test asks for a mode: "auto" compiles on the CPU in the background
# (omnidesk/models/runner.py), which would add minutes of compiling to every test that loads a model.
os.environ["OMNIDESK_COMPILE"] = "off"
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """variant -> (checkpoint dir, transformers reference model); written once per session."""
    import tiny

    cache = {}

    def get(variant: str):
        if variant not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{variant}")
            cache[variant] = (path, tiny.write_checkpoint(path, variant))
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def speech_like():
    """A deterministic 16 kHz test utterance: voiced harmonics with a moving pitch plus noise."""
    return speech_like_wave


@pytest.fixture
def ckpt(tiny_checkpoints, tmp_path):
    """A private, damageable copy of tiny checkpoint "a"."""
    return damageable_copy(tiny_checkpoints("a")[0], tmp_path / "ckpt")


@pytest.fixture(scope="session")
def sharded(tmp_path_factory):
    """Checkpoint "a" (same seed, same weights) written by transformers in several shards; do not damage it."""
    import tiny

    path = tmp_path_factory.mktemp("tiny-a-sharded")
    tiny.write_checkpoint(path, "a", max_shard_size="200KB")
    return path


@pytest.fixture(scope="module")
def one_thread():
    """Toy-sized ops run fastest on one thread (what load_moshi picks for a model this small), and a busy
    machine cannot stall them at a barrier; a module uses it with ``pytestmark``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_addoption(parser):
    parser.addoption("--busy-core", action="store_true",
                     help="keep one CPU core busy (a spinning process) during the real-time live tests, as a "
                          "user's machine is while it runs the model: tests/test_live*.py must pass so too")


@pytest.fixture(scope="session")
def busy_core(request):
    """With ``--busy-core``: a process spinning on one core for the session (None without)."""
    import subprocess

    if not request.config.getoption("--busy-core"):
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
