"""Local development environment: the real control plane, MinIO, kubectl and helm."""
