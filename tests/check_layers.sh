#!/usr/bin/env bash
# tests/check_layers.sh - the house's include order, checked (make check-layers; part of
# make test). docs/DESIGN.md section 2 draws it:
#
#   common <- kernels <- proto <- {expert_server, gpu_client/rpc} <- gpu_client/runner
#          <- gpu_client/cuda;   placement <- gpu_client/rpc (never proto);  deploy <- common
#
# A file may include headers of its own room and of the rooms below it (the arrows), never
# of a room above or beside it, and never another room's internal.h. Every quoted include
# is written from the repository root ("kernels/kn.h"), so that this check, a reader and
# the compiler (-I.) resolve it the same way; the generated "moe.pb-c.h" counts as proto.
# tests/ may include anything (tests reach into internals on purpose).
# Prints every violation as FILE:LINE: why; exits 1 if there is one.
set -u
cd "$(dirname "$0")/.."

room_of() { # path -> room name, or "" when not in a checked room
  case "$1" in
    common/*) echo common ;;
    kernels/*) echo kernels ;;
    proto/*|moe.pb-c.h) echo proto ;;
    expert_server/*) echo expert_server ;;
    gpu_client/rpc/*) echo rpc ;;
    gpu_client/runner/*) echo runner ;;
    gpu_client/cuda/*) echo cuda ;;
    placement/*) echo placement ;;
    deploy/*) echo deploy ;;
    *) echo "" ;;
  esac
}

# The rooms each room may include (itself included).
allowed() {
  case "$1" in
    common) echo "common" ;;
    kernels) echo "common kernels" ;;
    proto) echo "common kernels proto" ;;
    expert_server) echo "common kernels proto expert_server" ;;
    rpc) echo "common kernels proto rpc" ;;
    runner) echo "common kernels rpc runner" ;;
    cuda) echo "common kernels runner cuda" ;;
    placement) echo "common kernels rpc placement" ;;
    deploy) echo "common deploy" ;;
  esac
}

bad=0 files=0 includes=0
while IFS= read -r f; do
  from=$(room_of "$f")
  [ -n "$from" ] || continue
  files=$((files + 1))
  ok_rooms=" $(allowed "$from") "
  while IFS=: read -r line inc; do
    [ -n "$line" ] || continue
    includes=$((includes + 1))
    target=$inc
    if [ "$inc" != moe.pb-c.h ] && [ ! -f "$inc" ]; then
      echo "$f:$line: #include \"$inc\": not a path from the repository root (write e.g. \"kernels/kn.h\")"
      bad=$((bad + 1))
      continue
    fi
    to=$(room_of "$target")
    if [ -z "$to" ]; then
      echo "$f:$line: #include \"$inc\": $from may not include outside the rooms (tests/, build files)"
      bad=$((bad + 1))
    elif [[ $ok_rooms != *" $to "* ]]; then
      echo "$f:$line: #include \"$inc\": $from may include only [$(allowed "$from")], not $to (docs/DESIGN.md section 2)"
      bad=$((bad + 1))
    elif [ "$(basename "$inc")" = internal.h ] && [ "$to" != "$from" ]; then
      echo "$f:$line: #include \"$inc\": another room's internal.h (use its public header)"
      bad=$((bad + 1))
    fi
  done < <(grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' "$f" | sed -E 's/^([0-9]+):[^"]*"([^"]+)".*/\1:\2/')
done < <(git ls-files --cached --others --exclude-standard -- '*.c' '*.h' '*.cu' 2>/dev/null || find . -name '*.[ch]' -o -name '*.cu' | sed 's|^\./||')

if [ "$bad" -gt 0 ]; then
  echo "check-layers: $bad include(s) against the order, in $files files"
  exit 1
fi
echo "check-layers: ok ($includes includes in $files files follow the order)"
