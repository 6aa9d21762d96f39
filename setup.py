"""Package layout only (metadata is in pyproject.toml).

The design folders live at the repository root (`trt_plugins/`, `models/`, `engine_builder/`,
`server/`) but install as subpackages of the one `tilevox` package, so that site-packages gains a
single top-level name. pyproject.toml cannot prefix discovered packages, hence this mapping.

Folders without `__init__.py` (trt_plugins/csrc/**, server/riva_proto/protos/**) are namespace
packages here so that their data files ship (setuptools' way for data folders); the package-data
patterns below name the file kinds that installed code reads: the CUDA sources and tuning data that
`python -m tilevox.trt_plugins.build` compiles, the TensorRT plugin's linker script, and the Riva
.proto sources with their licence next to the stubs generated from them. tests/test_packaging.py
checks that a built wheel carries every such file of the source tree.
"""

from setuptools import find_namespace_packages, setup

DESIGN_FOLDERS = ("trt_plugins", "models", "executor", "engine_builder", "server")
# Local build output (trt_plugins/build/) and caches are not packages.
NOT_PACKAGES = ["build", "build.*", "*.build", "*.build.*", "__pycache__", "*.__pycache__"]
DATA_FILES = ["*.cu", "*.cuh", "*.h", "*.hpp", "*.cpp", "*.inc", "*.json", "*.map", "*.proto", "LICENSE"]

packages = ["tilevox"]
package_dir = {"tilevox": "tilevox"}
for folder in DESIGN_FOLDERS:
    package_dir[f"tilevox.{folder}"] = folder
    packages.append(f"tilevox.{folder}")
    packages += [f"tilevox.{folder}.{sub}" for sub in find_namespace_packages(folder, exclude=NOT_PACKAGES)]

setup(packages=packages, package_dir=package_dir, package_data={"": DATA_FILES})
