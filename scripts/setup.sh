#!/usr/bin/env bash
# Sets up gputrain in ./.venv, idempotently. Safe to run again; fast when nothing changed.
#
# torch: reuse any torch the base Python already has (the venv sees system site-packages, so a
# machine that ships its own CUDA build keeps it and needs no network); otherwise install exactly
# torch==2.13.0. Never an unpinned torch: pip would resolve it to the newest CUDA build (GBs).
#
# GPUTRAIN_TORCH=X.Y.Z (with GPUTRAIN_VENV, as `make test-torch TORCH=X.Y.Z` sets them): the venv
# must have exactly that torch release (any local build of it, +cpu or +cu130); installs
# torch==X.Y.Z when the one it sees is another, after checking that the disk has room for it
# (GPUTRAIN_TORCH_INSTALL_GB, default 10: see need_disk below).
#
# GPUTRAIN_EXTRAS (default test): the extras installed with gputrain, comma-separated; `make gpu-day-cpu`
# adds peers (Lightning and Accelerate, the speed table's peer rows).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${GPUTRAIN_VENV:-.venv}
TORCH=${GPUTRAIN_TORCH:-}
EXTRAS=${GPUTRAIN_EXTRAS:-test}
if ! [[ "$EXTRAS" =~ ^[a-z]+(,[a-z]+)*$ ]]; then
    echo "setup: GPUTRAIN_EXTRAS must be extras' names separated by commas, such as test,peers, not '$EXTRAS'" >&2
    exit 2
fi
WITH_BROWSER=0
WITH_POSTGRES=0
WITH_MYSQL=0
for arg in "$@"; do
    case "$arg" in
        --with-browser) WITH_BROWSER=1 ;;
        --with-postgres) WITH_POSTGRES=1 ;;
        --with-mysql) WITH_MYSQL=1 ;;
        *) echo "setup: unknown option '$arg' (known: --with-browser, --with-postgres, --with-mysql)" >&2; exit 2 ;;
    esac
done
if [ -n "$TORCH" ] && ! [[ "$TORCH" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    echo "setup: GPUTRAIN_TORCH must be an exact release such as 2.11.0, not '$TORCH'" >&2
    exit 2
fi

# need_disk DIR GB: stop before a download that cannot fit. A CUDA build of torch takes about 6 GB
# installed (torch 2.11.0: its nvidia libraries 2.7 GB, torch 1.2 GB, triton 0.6 GB) and its wheels,
# about 3.5 GB more, lie in pip's temporary folder until the install ends: 10 GB in all when the two
# share a disk. A full disk mid-install leaves a broken venv and an OSError deep in pip.
need_disk() {
    local dir=$1 gb=$2 tmp=${TMPDIR:-/tmp} avail_kb
    avail_kb=$(df -Pk "$dir" | awk 'NR==2 {print $4}')
    if [ "$(df -P "$dir" | awk 'NR==2 {print $1}')" != "$(df -P "$tmp" | awk 'NR==2 {print $1}')" ]; then
        # pip's temporary folder on another disk holds the wheels: each disk needs its own part.
        local tmp_kb
        tmp_kb=$(df -Pk "$tmp" | awk 'NR==2 {print $4}')
        if [ "$tmp_kb" -lt $((gb * 1024 * 1024 * 35 / 100)) ]; then
            echo "setup: torch==$TORCH's wheels need about $((gb * 35 / 100)) GB free in $tmp (pip's temporary folder), which has $((tmp_kb / 1024 / 1024)) GB: free some space, or point TMPDIR at a disk with room, and run this again" >&2
            exit 2
        fi
        gb=$((gb * 65 / 100))
    fi
    if [ "$avail_kb" -lt $((gb * 1024 * 1024)) ]; then
        echo "setup: installing torch==$TORCH in $dir needs about $gb GB free on its disk, which has $((avail_kb / 1024 / 1024)) GB: free some space (old venvs, temporary clones) and run this again; torch was not installed" >&2
        exit 2
    fi
}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"

if [ -n "$TORCH" ]; then
    if ! "$VPY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" >/dev/null 2>&1; then
        need_disk "$VENV" "${GPUTRAIN_TORCH_INSTALL_GB:-10}"
        echo "setup: installing torch==$TORCH in $VENV (several GB with its CUDA libraries)"
        # No pip cache: it would keep a second copy of every wheel (GBs) that nothing here reads again.
        "$VPY" -m pip install -q --no-cache-dir "torch==$TORCH"
    fi
elif ! "$VPY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: no importable torch, installing torch==2.13.0"
    "$VPY" -m pip install -q "torch==2.13.0"
fi

# Install the package (editable) and the test tools, the latter at the versions constraints.txt pins
# (the same pytest, type checker and coverage on every machine). A stamp skips pip when neither file
# changed. One stamp per set of extras: a venv set up for the tests alone still installs the peers
# when asked for them.
stamp="$VENV/.gputrain-installed-${EXTRAS//,/-}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ] \
        || ! "$VPY" -c "import gputrain" >/dev/null 2>&1; then
    # The torch that is there stays: no extra or test library may pull another build in its place.
    keep_torch=$(mktemp)
    # (the distribution's version: PyPI's CUDA wheels say 2.11.0 there but 2.11.0+cu130 in __version__)
    "$VPY" -c "import importlib.metadata as m; print(f'torch=={m.version(\"torch\")}')" > "$keep_torch"
    if ! "$VPY" -m pip install -q -c constraints.txt -c "$keep_torch" -e ".[$EXTRAS]"; then
        # No package index (an offline GPU machine): install gputrain alone and use what is there.
        echo "setup: pip could not fetch dependencies; installing gputrain without them (offline?)"
        if ! "$VPY" -m pip install -q --no-deps --no-build-isolation -e .; then
            # An old setuptools without `wheel` cannot build even an editable install offline
            # ("invalid command 'bdist_wheel'"): put src/ on the venv's path and write the command.
            echo "setup: no editable install possible here; putting $PWD/src on the venv's path instead"
            "$VPY" -c "import site, sys; open(site.getsitepackages()[0] + '/gputrain-src.pth', 'w').write(sys.argv[1] + '\n')" "$PWD/src"
            printf '#!/bin/sh\nexec "%s" -m gputrain "$@"\n' "$(cd "$(dirname "$VPY")" && pwd)/$(basename "$VPY")" > "$VENV/bin/gputrain"
            chmod +x "$VENV/bin/gputrain"
        fi
        missing=$("$VPY" - <<'PY'
import importlib.util
need = {"numpy": "numpy", "rich": "rich", "matplotlib": "matplotlib", "psutil": "psutil",
        "sklearn": "scikit-learn", "mnist1d": "mnist1d", "pynvml": "nvidia-ml-py", "pytest": "pytest",
        "tensorboard": "tensorboard"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
        if [ -n "$missing" ]; then
            echo "setup: missing packages: $missing (install them, or bring their wheels: pip install --no-index FILE.whl)"
        fi
    fi
    touch "$stamp"
fi

# apt_install PACKAGE WHAT: Debian's PACKAGE (as root with apt-get; a package list refreshed only when
# the first try fails), for WHAT; never fails the setup: the tests that need it skip and say why.
apt_install() {
    local package=$1 what=$2 log
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "setup: no $package: $what will skip (install it: sudo apt-get install $package)"
        return 0
    fi
    echo "setup: installing Debian's $package for $what (apt-get, about a minute)"
    log=$(mktemp)
    export DEBIAN_FRONTEND=noninteractive
    if timeout 600 apt-get install -y -qq --no-install-recommends "$package" >"$log" 2>&1 \
            || { timeout 300 apt-get update -qq >>"$log" 2>&1 \
                 && timeout 600 apt-get install -y -qq --no-install-recommends "$package" >>"$log" 2>&1; }; then
        echo "setup: $package installed"
    else
        echo "setup: could not install $package (see $log); $what will skip"
    fi
}

# --with-browser (make test): Chromium for the browser test of report.html, when missing. Fast when
# Chromium is already there: one `command -v`.
if [ "$WITH_BROWSER" = 1 ] && ! { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 \
        || command -v google-chrome >/dev/null 2>&1 || command -v google-chrome-stable >/dev/null 2>&1 \
        || [ -n "${GPUTRAIN_CHROMIUM:-}" ]; }; then
    apt_install chromium "the browser test of report.html"
fi

# --with-postgres (make test): Debian's PostgreSQL server, when its binaries are missing, for the tests
# of a sweep's study on a database server (tests/test_sweep_shared.py starts a throwaway cluster of its own
# with initdb and pg_ctl).
if [ "$WITH_POSTGRES" = 1 ] && ! { command -v pg_ctl >/dev/null 2>&1 \
        || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; }; then
    apt_install postgresql "the tests of sweeps on a database server"
fi
# --with-mysql (make test): Debian's MariaDB server (MySQL's protocol and SQL), when its binaries are
# missing, for the tests of a sweep's study on MySQL (tests/mysql_server.py starts a throwaway one).
if [ "$WITH_MYSQL" = 1 ] && ! { command -v mariadbd >/dev/null 2>&1 || command -v mysqld >/dev/null 2>&1 \
        || [ -x /usr/sbin/mariadbd ] || [ -x /usr/sbin/mysqld ]; }; then
    apt_install mariadb-server "the tests of sweeps on a MySQL server"
fi
"$VPY" -c "import torch, gputrain; print(f'setup: gputrain ready (torch {torch.__version__}) in $VENV')"
