// Command kubelet is the unmodified upstream node agent, built from the pinned
// k8s.io/kubernetes module: `posttrain dev up` runs it with containerd and runc so the
// cluster tests run real containers from the project's images.
package main

import (
	"context"
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kubelet/app"
)

func main() {
	os.Exit(cli.Run(app.NewKubeletCommand(context.Background())))
}
