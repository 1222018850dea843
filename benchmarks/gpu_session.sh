#!/usr/bin/env bash
# The GPU session's command at the path the guide gives (`bash benchmarks/gpu_session.sh day`, ...):
# it runs benchmarks/gpu_day/session.sh, which says what each part does, with the same arguments.
exec bash "$(dirname "$0")/gpu_day/session.sh" "$@"
