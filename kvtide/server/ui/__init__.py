"""The browser chat page served at GET / (off with `kvtide serve --no-ui`)."""
