#!/usr/bin/env bash
# Applies the session-15 diagnostic stamps to a copy of the tree: notes/s15/diag/apply.sh DEST (DEST: a copy).
exec python3 "$(dirname "$0")/apply.py" "$1"
