"""Package layout only (metadata is in pyproject.toml).

The design folders live at the repository root (`trt_plugins/`, `models/`, `engine_builder/`,
`server/`) but install as subpackages of the one `tilevox` package, so that site-packages gains a
single top-level name. pyproject.toml cannot prefix discovered packages, hence this mapping.
"""

from setuptools import find_packages, setup

DESIGN_FOLDERS = ("trt_plugins", "models", "engine_builder", "server")

packages = ["tilevox"]
package_dir = {"tilevox": "tilevox"}
for folder in DESIGN_FOLDERS:
    package_dir[f"tilevox.{folder}"] = folder
    packages.append(f"tilevox.{folder}")
    packages += [f"tilevox.{folder}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
