# shellcheck shell=bash
# shellcheck disable=SC2034  # uv_cmd is for the script that sources this file
# Sourced by bootstrap.sh and torch_floor.sh from the repository's root: sets the array uv_cmd to a uv that
# runs, installing one when none does. In this order: python3's own module (python3 -m uv); a uv on PATH (a site
# module, pipx, astral's installer); uv installed by pip into python3 (pip installs for this user alone when the
# Python is not the user's); and where pip refuses that too (Debian's and Ubuntu's Python for a user who is not
# root: "externally-managed-environment", PEP 668), into .uv-env/ here (ignored by git). When none works: one
# line saying how to get uv, exit status 2.
uv_cmd=()
if python3 -m uv --version >/dev/null 2>&1; then
    uv_cmd=(python3 -m uv)
elif command -v uv >/dev/null 2>&1; then
    uv_cmd=(uv)
elif [ -x .uv-env/bin/uv ]; then
    uv_cmd=(.uv-env/bin/uv)
else
    echo "installing uv with pip (for $(python3 --version 2>&1))" >&2
    uv_pip_log="$(mktemp)"
    if python3 -m pip install --quiet --disable-pip-version-check uv >"$uv_pip_log" 2>&1 \
            && python3 -m uv --version >/dev/null 2>&1; then
        uv_cmd=(python3 -m uv)
    elif python3 -m venv .uv-env >>"$uv_pip_log" 2>&1 \
            && .uv-env/bin/python -m pip install --quiet --disable-pip-version-check uv >>"$uv_pip_log" 2>&1; then
        echo "pip may not install into $(command -v python3) here: uv went into .uv-env/" >&2
        uv_cmd=(.uv-env/bin/uv)
    else
        rm -rf .uv-env
        echo "error: no uv, and pip could not install it ($(grep -v '^\s*$' "$uv_pip_log" | tail -n 1 | cut -c1-160)):" \
             "install uv (pipx install uv, or https://docs.astral.sh/uv/getting-started/installation/), then run this" \
             "again" >&2
        rm -f "$uv_pip_log"
        exit 2
    fi
    rm -f "$uv_pip_log"
fi
