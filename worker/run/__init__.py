"""The local `bulkinfer run` command and the engine-only demo: a file through the engine here, with no
servers."""
