#!/usr/bin/env bash
# Prepare, on a machine with the project installed, what a GPU machine without network access needs to train the
# real SmolLM2-135M-Instruct (`benchmarks/gpu_real.sh`): wheels of the pure-Python (and small binary) dependencies
# its image lacks, in .whl/, and the model's GGUF cut into pieces that fit beside the working tree in one transfer,
# in .gpu/. Both folders are ignored by git (the script adds them to .git/info/exclude).
#
#   bash benchmarks/gpu_kit.sh              # pieces of 25 MiB (PIECE_MB=... to change), wheels for Python 3.12
#
# It prints how big the working tree that travels with every call is, and the pieces: each call may carry 64 MiB
# with the tree, and the call that carries .whl/ should carry the smallest piece.
#
# The image this targets (recorded in benchmarks/README.md) has torch 2.11 and transformers, but not gymnasium,
# tensordict, torchrl, tyro or gguf; TORCHRL/TENSORDICT name the versions built for its torch.
#
#   bash benchmarks/gpu_kit.sh light        # leave the folders no device check reads out of what travels
#   bash benchmarks/gpu_kit.sh restore      # and put them back (do this before any commit)
#
# `light` takes benchmarks/results/ and retrievers/data/ (together about 35 MiB) out of git's index and ignores
# them, so that two 25 MiB pieces fit in one call; the files stay on disk, and `restore` puts the index and the
# exclude file back as they were. It refuses to run with changes staged, which `restore` would unstage.
set -euo pipefail
LIGHT=(benchmarks/results retrievers/data)
exclude=$(git rev-parse --git-path info/exclude)
case ${1:-} in
  light)
    git diff --cached --quiet || { echo "changes are staged: commit or unstage them first" >&2; exit 1; }
    git rm -r -q --cached "${LIGHT[@]}"
    { echo "# gpu_kit.sh light:"; for path in "${LIGHT[@]}"; do echo "/$path/"; done; } >>"$exclude"
    travels=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -n 1 | cut -f1)
    echo "working tree that travels with every call: $((travels / 1048576)) MiB; 'bash $0 restore' before committing"
    exit 0
    ;;
  restore)
    git reset -q -- "${LIGHT[@]}"
    sed -i -e '/^# gpu_kit.sh light:$/d' -e '\#^/benchmarks/results/$#d' -e '\#^/retrievers/data/$#d' "$exclude"
    git status --short -- "${LIGHT[@]}"
    exit 0
    ;;
esac
PIECE_MB=${PIECE_MB:-25}
TORCHRL=${TORCHRL:-0.12.0}
TENSORDICT=${TENSORDICT:-0.12.4}
mkdir -p "$(dirname "$exclude")"
for path in /.whl/ /.gpu/; do grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >>"$exclude"; done

rm -rf .whl && mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any)
for package in "torchrl==$TORCHRL" "tensordict==$TENSORDICT" gymnasium farama-notifications tyro docstring-parser \
  typeguard gguf pyvers orjson importlib_metadata; do
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$package"
done

rm -rf .gpu && mkdir -p .gpu
gguf=$(python -c "from agents.models import smollm2_gguf_path; print(smollm2_gguf_path())")
split -b "${PIECE_MB}M" -d "$gguf" .gpu/smollm2.gguf.part
sha256sum "$gguf" | cut -d' ' -f1 >.gpu/smollm2.gguf.sha256
travels=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -n 1 | cut -f1)
echo "working tree that travels with every call: $((travels / 1048576)) MiB (a call carries at most 64 MiB)"
du -b .whl | awk '{printf ".whl: %.1f MiB\n", $1 / 1048576}'
ls -l .gpu | awk 'NR > 1 {printf "%s %.1f MiB\n", $NF, $5 / 1048576}'
