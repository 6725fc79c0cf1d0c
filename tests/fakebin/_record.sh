# shellcheck shell=bash
# Sourced by the fakes in the folders beside it: append "name<TAB>arg<TAB>arg..." to $SHARDIO_FAKE_LOG.
if [[ -n "${SHARDIO_FAKE_LOG:-}" ]]; then
    _line="${0##*/}"
    for _arg in "$@"; do _line+=$'\t'"$_arg"; done
    printf '%s\n' "$_line" >>"$SHARDIO_FAKE_LOG"
    unset _line _arg
fi
