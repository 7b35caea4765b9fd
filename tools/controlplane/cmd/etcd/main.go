// Command etcd is the unmodified upstream etcd server at the version the
// pinned kube-apiserver is built against.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
