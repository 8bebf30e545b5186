#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/sidecar_epilog.sh): runs as root on every
# node of a job when it ends. Tells the node's sidecar to finish the job's runs now
# (a run that did not call finish() is written, marked incomplete, cause "Slurm job
# ended") instead of waiting to notice its processes are gone.
# Never fails: a non-zero status from an Epilog drains the node.
SIDECAR=${SIDECAR:-/opt/trainmon/bin/sidecar}
[ -n "$SLURM_JOB_ID" ] || exit 0
for socket in /run/sidecar/sidecar.sock "/run/sidecar-$SLURM_JOB_USER/sidecar.sock"; do
    if [ -S "$socket" ]; then
        "$SIDECAR" finish --job "$SLURM_JOB_ID" --endpoint "ipc://$socket" || true
    fi
done
exit 0
