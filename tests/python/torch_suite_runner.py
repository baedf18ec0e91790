"""PyTorch's own distributed suite (torch.testing._internal.distributed.distributed_test) run
against backend "ep"; test_torch_suite.py starts it in a process of its own.

The suite picks most of its cases by backend name (`BACKEND == "gloo"`), so the module is
imported as if for gloo (that selects gloo's cases: CPU tensors, timeouts, monitored barriers,
sparse all_reduce, DDP on CPU) and then told that the backend is "ep", which is what every
process group in it is created with. Run as `python torch_suite_runner.py -k <names>` or
through pytest."""

import os
import sys
import tempfile

os.environ["BACKEND"] = "gloo"  # read by the suite at import: gloo's selection of cases
os.environ.setdefault("WORLD_SIZE", "2")
if "TEMP_DIR" not in os.environ:  # (the spawned ranks inherit it: only a runner started by hand makes one)
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="moelink-torch-suite-")

import moelink  # noqa: E402,F401  (registers backend "ep")
import torch.testing._internal.distributed.distributed_test as suite  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402

suite.BACKEND = "ep"  # what _run passes to init_process_group, and what the cases compare with


class TestEpWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    sys.exit(run_tests())
