#!/usr/bin/env bash
# Archive the FM AutoAttack runs as they stand, without stopping them: copy the run folder (a save
# is a rename, so a copy reads each state file whole, old or new), pack the copy, check that the
# archive extracts to runs that `robust-attn status` reads, then replace the committed archive.
# A saved state over 25 MB (APGD's, mid-member: 53-67 MB) is left out of the archive, so that git
# does not carry it: that radius starts again from its beginning on a machine restored from the
# archive (a machine that keeps runs/ resumes it as saved).
# Usage (from the repository root): bash reports/in-progress/snapshot.sh
set -euo pipefail
name=study-fashion_mnist-aa4
archive=reports/in-progress/$name.tar.xz
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/copy" "$tmp/check"
cp -a "runs/$name" "$tmp/copy/"
find "$tmp/copy/$name" -path '*/partial/*' -type f -size +25M -print -delete \
  | sed "s#$tmp/copy/#left out of the archive (over 25 MB; that radius restarts from a fresh machine): #"
tar -C "$tmp/copy" --exclude=claims --exclude='*.tmp' -cJf "$tmp/new.tar.xz" "$name"
tar -xJf "$tmp/new.tar.xz" -C "$tmp/check"
.venv/bin/robust-attn status "$tmp/check/$name" > "$tmp/status.txt"   # exits non-zero on a damaged run
mv "$tmp/new.tar.xz" "$archive"
sed "s#$tmp/check/##" "$tmp/status.txt"
ls -l "$archive"
