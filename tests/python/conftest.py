import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, os.path.join(ROOT, "integration")):
    if p not in sys.path:
        sys.path.insert(0, p)
# Spawned children find the package and the case modules through the environment.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [HERE, os.path.join(ROOT, "integration")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)
