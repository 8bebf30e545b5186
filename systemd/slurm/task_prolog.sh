#!/bin/sh
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/sidecar_task_prolog.sh): runs as the
# job's user before each task; "export NAME=value" and "unset NAME" lines on its stdout
# change the task's environment. Points the markers at the node's sidecar: the user's own
# instance (sidecar@<user>.service) when it runs, else the node daemon (sidecar.service).
# A job that sets SIDECAR_ENDPOINT itself keeps its own. An endpoint this script chose on
# another node is chosen again here: srun passes the batch script's environment (set by
# this script on the job's first node) on to the tasks of every node, and what runs there
# may differ (a user's instance on one node only); SIDECAR_PROLOG_ENDPOINT says which
# endpoint this script chose. SIDECAR_SOCKET_ROOT: the folder holding the daemons' socket
# folders (systemd's RuntimeDirectory: /run).
if [ -n "$SIDECAR_ENDPOINT" ] && [ "$SIDECAR_ENDPOINT" != "$SIDECAR_PROLOG_ENDPOINT" ]; then
    exit 0
fi
user=${SLURM_JOB_USER:-$(id -un)}
run=${SIDECAR_SOCKET_ROOT:-/run}
for socket in "$run/sidecar-$user/sidecar.sock" "$run/sidecar/sidecar.sock"; do
    if [ -S "$socket" ]; then
        echo "export SIDECAR_ENDPOINT=ipc://$socket"
        echo "export SIDECAR_PROLOG_ENDPOINT=ipc://$socket"
        exit 0
    fi
done
# no sidecar on this node: the endpoint of another node's is no use here
if [ -n "$SIDECAR_ENDPOINT" ]; then
    echo "unset SIDECAR_ENDPOINT"
fi
exit 0
