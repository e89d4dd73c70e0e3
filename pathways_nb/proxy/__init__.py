"""The proxy server: the IFRT proxy protocol, sessions, the cluster runtime."""
