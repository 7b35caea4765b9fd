// Command kube-controller-manager is the unmodified upstream controller manager
// (Deployments, ReplicaSets, Jobs, the garbage collector, ...), built from the pinned
// k8s.io/kubernetes module for `posttrain dev up`'s single-node cluster.
package main

import (
	"os"
	_ "time/tzdata" // CronJob time zones

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() {
	os.Exit(cli.Run(app.NewControllerManagerCommand()))
}
