#!/usr/bin/env bash
# Lays out an old commit's cuattn for bench/ab.py: DIR/cuattn_old/ (the commit's cuattn/
# package, renamed) and DIR/cuda_src/ (its kernel sources, which the package finds at
# <package>/../cuda_src). Checks that the package imports itself only relatively, so the
# renamed copy cannot pull in the new tree's modules.
#
#   scripts/ab_prepare.sh COMMIT DIR        e.g. scripts/ab_prepare.sh d8d8b39 out/ab_old
#   PYTHONPATH=. python bench/ab.py --old DIR
set -euo pipefail

if [[ $# -ne 2 ]]; then
    echo "usage: $0 COMMIT DIR" >&2
    exit 2
fi
commit=$(git rev-parse --verify "$1^{commit}")
dir=$2

mkdir -p "$dir"
rm -rf "$dir/cuattn_old" "$dir/cuda_src" "$dir/cuattn"
git archive --format=tar "$commit" cuattn cuda_src | tar -x -C "$dir"
# (the optional framework adapters import cuattn by name and play no part in an A/B)
rm -f "$dir/cuattn/jax.py" "$dir/cuattn/torch.py"
mv "$dir/cuattn" "$dir/cuattn_old"
echo "$commit" > "$dir/COMMIT"

# Absolute self-imports would load the *new* cuattn from the renamed copy.
if grep -rnE --include='*.py' \
        -e '^[[:space:]]*(import|from)[[:space:]]+cuattn([.[:space:]]|$)' \
        -e 'import_module\(["'\'']cuattn' "$dir/cuattn_old"; then
    echo "$0: the lines above import cuattn absolutely; the A/B would mix the two trees" >&2
    exit 1
fi
[[ -d "$dir/cuda_src/common" ]] || { echo "$0: $dir/cuda_src/common missing" >&2; exit 1; }
echo "prepared $dir from $commit: $(find "$dir/cuattn_old" -name '*.py' | wc -l) modules," \
     "$(find "$dir/cuda_src" -type f | wc -l) kernel source files"
