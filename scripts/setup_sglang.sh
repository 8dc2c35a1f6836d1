#!/usr/bin/env bash
# Install SGLang 0.5.23 into its own venv (not .venv: it brings ~11 GB and its own torch/transformers).
# Cached between runs: a stamp inside the venv is written only after a whole, verified install, so a
# half-done one is redone; with the stamp in place this is a no-op well under a second.
#   TANDEM_SGLANG_VENV  where the venv lives (default ~/.cache/tandem/sglang-0.5.23)
#   PYTHON              the interpreter that creates it (default python3.11)
# With --check it installs nothing: exit 0 when the venv is ready, 1 when a run would install.
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.5.23
venv="${TANDEM_SGLANG_VENV:-$HOME/.cache/tandem/sglang-$version}"
stamp="$venv/.tandem-sglang-stamp"
# Changing this script (another pin, another step) redoes the install; pip keeps that fast.
want="sglang==$version $(sha256sum <scripts/setup_sglang.sh | cut -d' ' -f1)"

stamped() { [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$venv/bin/python" ]]; }
stamped && exit 0
[[ "${1:-}" == "--check" ]] && exit 1

mkdir -p "$(dirname "$venv")"
# One installer at a time (make test and the pytest fixture may both call this); the others wait.
exec 9>"$venv.lock"
if ! flock -n 9; then
  echo "setup_sglang: another install into $venv is running; waiting for it" >&2
  flock 9
fi
stamped && exit 0

python="${PYTHON:-python3.11}"
if ! command -v "$python" >/dev/null; then
  echo "setup_sglang: $python not found; SGLang $version needs Python 3.11 (set PYTHON=...)" >&2
  exit 1
fi
started=$SECONDS
rm -f "$stamp"
if [[ ! -x "$venv/bin/python" ]]; then
  echo "setup_sglang: creating $venv" >&2
  "$python" -m venv "$venv"
fi
# SGLang $version pins torch 2.14.1; on this machine pip's site constraints (/etc/xdg/pip) cap torch
# at the release that lies on local disk, which is that one, so no other torch build is fetched.
echo "setup_sglang: pip install sglang==$version (into a fresh venv: 5-10 min, ~11 GB)" >&2
# -qq: errors only; this machine's pip config lists local indexes that each print a warning.
"$venv/bin/python" -m pip install -qq --disable-pip-version-check "sglang==$version"

echo "setup_sglang: checking the install" >&2
"$venv/bin/python" - "$version" <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

want = sys.argv[1]
got = md.version("sglang")
if got != want:
    sys.exit(f"setup_sglang: sglang {got} is installed, not {want}")
# The CPU stand-in (server/engines/sglang_cpu) wraps the real sgl_kernel package, so it must be there.
for module in ("sglang", "sgl_kernel", "torch", "transformers"):
    if importlib.util.find_spec(module) is None:
        sys.exit(f"setup_sglang: {module} is missing after the install")
EOF
echo "$want" >"$stamp"
echo "setup_sglang: ready in $((SECONDS - started)) s: $venv" >&2
