# Sourced by the benchmark scripts. wait_up URL [PID]: returns once URL answers while PID (default: the
# last job started in the background, the server just launched) is still running. Stops the script when
# URL already answered at the call (a server left on that port would answer in the new one's place, its
# figures under the new label), when the server exits, or after 300 s.
wait_up() {
    local url=$1 pid=${2:-$!}
    if curl -sf "$url" >/dev/null; then echo "$0: $url already answers; stop that server first" >&2; exit 1; fi
    for i in $(seq 300); do
        kill -0 "$pid" 2>/dev/null || { echo "$0: the server for $url exited (see its log in /tmp)" >&2; exit 1; }
        curl -sf "$url" >/dev/null && return 0
        sleep 1
    done
    echo "$0: $url not up after 300 s" >&2
    exit 1
}
