"""The transfer engine: chunk planning, the buffer pool, pipelined uploads and downloads, streams, I/O threads."""
