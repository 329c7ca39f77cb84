#!/bin/bash
# A/B served: base (HEAD worktree) vs new (working tree), alternated
source /work/main/.venv/bin/activate
for r in 1 2; do
for v in base new; do
  if [ $v = base ]; then d=/tmp/p/base; else d=/work/main; fi
  (cd $d && python -m eval.field_bench --servers d3d --datasets random --levels 16,64 --out /tmp/p/ab_${v}_$r --plot /tmp/p/ab_${v}_$r/p.png 2>&1 | grep "^| random\|^| long" | sed "s/^/$v r$r /")
done; done
