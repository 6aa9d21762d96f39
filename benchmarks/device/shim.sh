# Sourced by the device scripts, from the repository root: tilevox importable from the working tree without installing
# it. /tmp/tilevox-src/tilevox mirrors setup.py's package_dir (tilevox/__init__.py, and each of its DESIGN_FOLDERS as
# tilevox.<folder>) as symlinks. Sets `repo` and PYTHONPATH: the shim first (the repo's own tilevox/ holds only the
# namespace's __init__ and would shadow it), /tmp/site (wheels a script unpacks there), the repo (benchmarks).
repo=$PWD
mkdir -p /tmp/tilevox-src/tilevox
ln -sf "$repo/tilevox/__init__.py" /tmp/tilevox-src/tilevox/__init__.py
for folder in $(sed -n 's/^DESIGN_FOLDERS = (\(.*\))$/\1/p' "$repo/setup.py" | tr -d '",'); do
  ln -sfn "$repo/$folder" "/tmp/tilevox-src/tilevox/$folder"
done
export PYTHONPATH=/tmp/tilevox-src:/tmp/site:$repo PYTHONUNBUFFERED=1
