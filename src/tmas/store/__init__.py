"""The SQLite run store: every finished call made durable before its result is used (so a resumed run replays it),
iteration records, results, run metadata and notices, with call texts kept once each by content hash."""
