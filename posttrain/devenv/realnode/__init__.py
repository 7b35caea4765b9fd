"""A real single-node cluster (kubelet, containerd, runc, CNI, kube-proxy, CoreDNS) for
``posttrain dev up`` and the ``real_cluster`` tests: see :mod:`.cluster`."""
