#!/usr/bin/env bash
# Installs fxpar (editable) and what it needs.
#   bash scripts/install.sh                # the package; an installed torch is kept
#   bash scripts/install.sh --test         # the package and the test and documentation tools
#   bash scripts/install.sh --test --lowest  # every dependency at the lowest version fxpar
#                                          # declares (scripts/lowest-versions.txt; CI's quick tier)
#   bash scripts/install.sh --test --newest  # every dependency at the newest the index serves
#                                          # (CI's full suite)
# Without --lowest/--newest an installed torch is never replaced (a GPU user's CUDA build
# stays); a machine without torch gets $FXPAR_DEFAULT_TORCH, the newest torch the whole suite
# has passed on.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEFAULT_TORCH=${FXPAR_DEFAULT_TORCH:-2.15.0}
extra="" mode="keep"
for arg in "$@"; do
  case "$arg" in
    --test) extra="[test]" ;;
    --lowest) mode="lowest" ;;
    --newest) mode="newest" ;;
    *) echo "fxpar install: unknown option $arg (accepted: --test, --lowest, --newest)" >&2; exit 2 ;;
  esac
done
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }
case "$mode" in
  lowest)
    echo "fxpar install: the lowest declared versions (scripts/lowest-versions.txt)"
    grep -v '^#' scripts/lowest-versions.txt | grep -v '^$' > /tmp/fxpar-lowest.$$.txt
    if [ -z "$extra" ]; then  # the test tools' pins only with --test
      grep -v -E '^(pytest|hypothesis|matplotlib|sphinx|myst-parser)==' /tmp/fxpar-lowest.$$.txt > /tmp/fxpar-lowest.$$.b && mv /tmp/fxpar-lowest.$$.b /tmp/fxpar-lowest.$$.txt
    fi
    pip_install -r /tmp/fxpar-lowest.$$.txt
    rm -f /tmp/fxpar-lowest.$$.txt
    pip_install --no-deps -e ".${extra}"
    ;;
  newest)
    # the index's newest releases, torch included: a site-wide pip constraint that caps torch
    # (as /etc/xdg/pip does on this project's machines) is replaced by none for this install only
    echo "fxpar install: the newest versions the index serves"
    PIP_CONSTRAINT=/dev/null pip_install --upgrade --upgrade-strategy eager -e ".${extra}" torch
    ;;
  keep)
    if "$PY" -c "import torch" 2>/dev/null; then
      echo "fxpar install: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
      pip_install -e ".${extra}"
    else
      echo "fxpar install: no torch found, installing torch==$DEFAULT_TORCH (the index's CUDA build: it also runs on a CPU)"
      # a site-wide pip constraint that caps torch below it (this project's machines have one)
      # is set aside for this one package: FXPAR_DEFAULT_TORCH picks another version
      PIP_CONSTRAINT=/dev/null pip_install "torch==$DEFAULT_TORCH"
      PIP_CONSTRAINT=/dev/null pip_install -e ".${extra}"  # the same cap would move torch back
    fi
    ;;
esac
"$PY" -m pip check --disable-pip-version-check | grep -v "^No broken" || true
"$PY" -c "import fxpar, torch, transformers; print(f'fxpar {fxpar.__version__} installed (torch {torch.__version__}, transformers {transformers.__version__})')"
