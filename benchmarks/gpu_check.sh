#!/usr/bin/env bash
# benchmarks/gpu_check.py with the project's venv (VENV, else .venv); arguments pass through
here=$(dirname "$0"); exec "${VENV:-$here/../.venv}/bin/python" "$here/gpu_check.py" "$@"
