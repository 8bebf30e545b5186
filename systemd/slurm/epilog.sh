#!/bin/sh
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/sidecar_epilog.sh): runs as root on every
# node of a job when it ends. Tells the node's sidecars to finish the job's runs now: a
# run still going (it did not call finish()), or one whose processes Slurm killed first
# (scancel, time limit), is written incomplete with the cause "Slurm job N ended".
# With SIDECAR_JOB_REPORT_ROOTS set (folders holding run folders, space-separated), it
# then writes the job's efficiency report (`sidecar report --job`) into the job's run
# folder as efficiency.txt, as the job's user when runuser can switch to them.
# Never fails: a non-zero status from an Epilog drains the node.
# SIDECAR: the sidecar command; SIDECAR_SOCKET_ROOT: the folder holding the daemons'
# socket folders (systemd's RuntimeDirectory: /run).
SIDECAR=${SIDECAR:-/opt/trainmon/bin/sidecar}
run=${SIDECAR_SOCKET_ROOT:-/run}
[ -n "$SLURM_JOB_ID" ] || exit 0
for socket in "$run/sidecar/sidecar.sock" "$run/sidecar-$SLURM_JOB_USER/sidecar.sock"; do
    if [ -S "$socket" ]; then
        "$SIDECAR" finish --job "$SLURM_JOB_ID" --endpoint "ipc://$socket" || true
    fi
done
if [ -n "$SIDECAR_JOB_REPORT_ROOTS" ]; then
    as_user=""
    if [ -n "$SLURM_JOB_USER" ] && [ "$(id -u)" = 0 ] && command -v runuser >/dev/null; then
        as_user="runuser -u $SLURM_JOB_USER --"
    fi
    # shellcheck disable=SC2086  # the roots and the runuser words are split on purpose
    $as_user "$SIDECAR" report --job "$SLURM_JOB_ID" --into-folder $SIDECAR_JOB_REPORT_ROOTS \
        >/dev/null 2>&1 || true
fi
exit 0
