"""A stand-in for the machine's MTA (``/usr/sbin/sendmail``): it keeps each message it is handed
as one ``.eml`` file in a folder.

It delivers as maildir does (maildir(5): written under ``tmp/``, then renamed into ``new/``): a
message is written under another name and renamed, so that a reader of ``*.eml`` never sees half
of one (a test once read a mail that ``cat`` was still writing, without its ``To`` header)."""

from __future__ import annotations

from pathlib import Path


def write_sendmail(program: Path, mail_dir: Path) -> Path:
    """Write the stand-in to ``program`` (executable), delivering into ``mail_dir`` (made)."""
    mail_dir.mkdir(parents=True, exist_ok=True)
    program.write_text(f"#!/bin/sh\nname={mail_dir}/$$.$(date +%s%N)\n"
                       'cat > "$name.part" && mv "$name.part" "$name.eml"\n')
    program.chmod(0o755)
    return program
