"""Reference mesh services and the client SDK they use."""
