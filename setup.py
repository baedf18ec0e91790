"""`pip install --no-build-isolation .`: builds moelink._C with CMake against the
installed torch and packages it. (Build isolation would build against a different torch.)"""

import os
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class BuildWithCMake(build_py):
    def run(self):
        build_dir = os.path.join(ROOT, "build-pip")
        subprocess.check_call(
            ["cmake", "-S", ROOT, "-B", build_dir, "-G", "Ninja", "-DMOELINK_BUILD_TESTS=OFF",
             f"-DPython3_EXECUTABLE={sys.executable}"]
        )
        subprocess.check_call(["ninja", "-C", build_dir, "moelink_python"])
        super().run()
        # The CMake target placed _C and _build_info next to the sources; ship them.
        pkg_src = os.path.join(ROOT, "integration", "moelink")
        pkg_dst = os.path.join(self.build_lib, "moelink")
        os.makedirs(pkg_dst, exist_ok=True)
        for name in os.listdir(pkg_src):
            if name.startswith("_C") or name == "_build_info.py":
                self.copy_file(os.path.join(pkg_src, name), os.path.join(pkg_dst, name))


setup(cmdclass={"build_py": BuildWithCMake})
