#!/usr/bin/env bash
# Fill what the GPU proof needs on a GPU machine without internet; run it where there is internet.
#
#   bash scripts/gpu_proof_prepare.sh [--no-wheels] [PYTHON_VERSION]   # default 3.12, the GPU machine's Python
#   EXAMPLES_GIT=/path/to/a/clone bash scripts/gpu_proof_prepare.sh   # pytorch/examples from elsewhere
#
# - .whl/: wheels (x86_64 Linux, CPython PYTHON_VERSION) of the course's dependencies that a GPU
#   image often lacks: line_profiler (Lab-02), py-spy (Lab-06's doctor), PyYAML (the site profiles Lab-05
#   reads its link's peak from; webdataset's too), webdataset with braceexpand and torchdata (Lab-08), at
#   the versions of uv.lock (no dependencies: webdataset's numpy is the image's).
#   scripts/gpu_proof.sh installs them into a private folder before any check.
# - .examples/: pytorch/examples (a shallow clone), whose mnist/main.py the Chapter 4 speed target
#   is measured against. Both folders are ignored by git; a device lease carries them (carry: .whl,
#   .examples).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
packages=(line-profiler py-spy pyyaml webdataset braceexpand torchdata)
if [[ ${1:-} == --no-wheels ]]; then packages=(); shift; fi
version=${1:-3.12}
if [[ ! $version =~ ^3\.[0-9]+$ || $# -gt 1 ]]; then  # before anything is written: pip would print its whole usage
    echo "error: expected [--no-wheels] [PYTHON_VERSION like 3.12], got: $* (see bash $0 --help)" >&2
    exit 2
fi
locked() {  # the version uv.lock pins for a package
    awk -v name="$1" '$0 == "name = \"" name "\"" {getline; gsub(/version = |"/, ""); print; exit}' uv.lock
}
mkdir -p .whl
for package in "${packages[@]}"; do
    pin=$(locked "$package")
    [[ -n $pin ]] || { echo "error: uv.lock pins no $package" >&2; exit 1; }
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
        -d .whl "$package==$pin"
done
examples_git=${EXAMPLES_GIT:-https://github.com/pytorch/examples}
if [[ ! -f .examples/mnist/main.py || ! -f .examples/SOURCE || -d .examples/.git ]]; then
    rm -rf .examples.clone
    if [[ -d .examples/.git ]]; then  # an earlier fill, a whole clone: its mnist/ is kept, the rest goes
        mv .examples .examples.clone
    else
        rm -rf .examples
        # Only mnist/ and LICENSE are checked out: a mirror may lack the repository's large data files.
        git clone --quiet --depth 1 --no-checkout "$examples_git" .examples.clone 2>/dev/null &&
            git -C .examples.clone checkout --quiet HEAD -- mnist 2>/dev/null &&
            git -C .examples.clone checkout --quiet HEAD -- LICENSE 2>/dev/null || true
    fi
    if [[ -f .examples.clone/mnist/main.py ]]; then
        mkdir .examples
        cp -R .examples.clone/mnist .examples/
        if [[ -f .examples.clone/LICENSE ]]; then cp .examples.clone/LICENSE .examples/; fi
        from=$(git -C .examples.clone remote get-url origin 2>/dev/null || echo "$examples_git")
        echo "pytorch/examples $(git -C .examples.clone rev-parse --short HEAD) ($from)" > .examples/SOURCE
    fi
    rm -rf .examples.clone
fi
wheels=(.whl/*.whl)
[[ -e ${wheels[0]} ]] || wheels=()
if [[ ! -f .examples/mnist/main.py ]]; then
    echo "gpu_proof_prepare: ${#wheels[@]} wheel(s) in .whl/; error: no pytorch/examples from $examples_git" \
         "(the proof would skip ch04_vs_examples): set EXAMPLES_GIT to a clone or a mirror of it" >&2
    exit 1
fi
echo "gpu_proof_prepare: ${#wheels[@]} wheel(s) in .whl/, $(head -n 1 .examples/SOURCE), $(du -sh .examples | cut -f1) in .examples/"
