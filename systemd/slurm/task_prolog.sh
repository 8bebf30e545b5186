#!/bin/sh
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/sidecar_task_prolog.sh): runs as the
# job's user before each task; "export NAME=value" lines on its stdout enter the task's
# environment. Points the markers at the node's sidecar: the user's own instance
# (sidecar@<user>.service) when it runs, else the node daemon (sidecar.service). A job
# that sets SIDECAR_ENDPOINT itself keeps its own. SIDECAR_SOCKET_ROOT: the folder holding
# the daemons' socket folders (systemd's RuntimeDirectory: /run).
[ -n "$SIDECAR_ENDPOINT" ] && exit 0
user=${SLURM_JOB_USER:-$(id -un)}
run=${SIDECAR_SOCKET_ROOT:-/run}
for socket in "$run/sidecar-$user/sidecar.sock" "$run/sidecar/sidecar.sock"; do
    if [ -S "$socket" ]; then
        echo "export SIDECAR_ENDPOINT=ipc://$socket"
        break
    fi
done
exit 0
