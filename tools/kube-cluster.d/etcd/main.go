// Command etcd is the upstream etcd server, built from the published
// go.etcd.io/etcd/server/v3 module because its repository root (the module that
// holds etcd's own main) is not importable; tools/kube-cluster runs it as the
// cluster's store.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
