// Command netpol enforces NetworkPolicies on the local cluster's pod network with SIG
// Network's reference implementation, sigs.k8s.io/kube-network-policies, used as a library:
// its controller watches the cluster's policies, namespaces and pods, reads the first packet
// of every new connection from an nfqueue, and accepts or drops it by the policies of both
// ends.
//
// What differs from upstream's DaemonSet, and why:
//
//   - Which packets reach the queue. Upstream steers them with an nftables `queue`
//     statement; this machine's kernel is built without it (CONFIG_NFT_QUEUE is not set, so
//     the rule fails with ENOENT), but it has the xtables NFQUEUE target. So this command
//     installs upstream's steering rules through iptables instead, in their order: DNS,
//     traffic of the host's root user (kubelet probes) and established connections pass;
//     a new connection from or to the pod network is queued. Upstream narrows the last rule
//     to the pods a policy selects; queuing them all only asks the controller about more
//     connections (a pod no policy selects is allowed, as upstream decides it).
//
//   - One process for all nodes. The local cluster's nodes share the host's network
//     namespace and one bridge; bridged pod-to-pod packets meet the rules through
//     br_netfilter (net.bridge.bridge-nf-call-iptables=1).
//
//     netpol --kubeconfig FILE --pod-cidr CIDR [--queue N] [--chain NAME]
//
// It runs until SIGINT or SIGTERM, then removes its rules. While it runs, a packet it cannot
// decide is dropped (fail-closed, upstream's default).
package main

import (
	"context"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"
	"sigs.k8s.io/kube-network-policies/pkg/networkpolicy"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "netpol:", err)
		os.Exit(1)
	}
}

func run() error {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster (required)")
	podCIDR := flag.String("pod-cidr", "", "the pod network, e.g. 10.244.0.0/16 (required)")
	queue := flag.Int("queue", 100, "nfqueue number")
	chain := flag.String("chain", "SFTJOB-NETPOL", "iptables chain (mangle table) holding the steering rules")
	klog.InitFlags(nil)
	flag.Parse()
	if *kubeconfig == "" || *podCIDR == "" {
		flag.Usage()
		return fmt.Errorf("--kubeconfig and --pod-cidr are required")
	}
	if _, _, err := net.ParseCIDR(*podCIDR); err != nil {
		return fmt.Errorf("--pod-cidr: %w", err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		return fmt.Errorf("reading %s: %w", *kubeconfig, err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer cancel()

	factory := informers.NewSharedInformerFactory(client, 0)
	controller, err := networkpolicy.NewController(client,
		factory.Networking().V1().NetworkPolicies(), factory.Core().V1().Namespaces(),
		factory.Core().V1().Pods(), nil, nil, nil, nil,
		networkpolicy.Config{
			QueueID: *queue,
			// Not a node's name: upstream's own nftables rules (which this kernel refuses)
			// would select no pod, so on a kernel that has them they queue nothing twice.
			NodeName:            "sftjob-netpol-host",
			NFTableName:         "sftjob-netpol",
			NetfilterBug1766Fix: true,
		})
	if err != nil {
		return err
	}
	factory.Start(ctx.Done())
	done := make(chan error, 1)
	go func() { done <- controller.Run(ctx) }()

	// Steer packets only once the controller reads the queue: a packet queued before that
	// would be dropped (the queue has no reader), not decided.
	if err := waitForQueue(ctx, *queue, done); err != nil {
		return err
	}
	steering := rules(*chain, *podCIDR, *queue)
	removeRules(*chain) // a chain left by a killed run
	if err := installRules(*chain, steering); err != nil {
		cancel()
		<-done
		removeRules(*chain)
		return err
	}
	defer removeRules(*chain)
	klog.Infof("enforcing NetworkPolicies on %s (queue %d, chain mangle/%s)", *podCIDR, *queue, *chain)
	fmt.Println("ready") // the tests wait for this line

	select {
	case <-ctx.Done():
		return <-done
	case err := <-done:
		if err == nil {
			err = fmt.Errorf("the controller stopped")
		}
		return err
	}
}

// waitForQueue returns when a process reads nfqueue `queue` (the kernel lists it in
// /proc/net/netfilter/nfnetlink_queue), or fails when the controller stops first.
func waitForQueue(ctx context.Context, queue int, done <-chan error) error {
	for {
		table, err := os.ReadFile("/proc/net/netfilter/nfnetlink_queue")
		if err != nil {
			return fmt.Errorf("this kernel has no nfnetlink_queue: %w", err)
		}
		for _, line := range strings.Split(string(table), "\n") {
			if f := strings.Fields(line); len(f) > 0 && f[0] == strconv.Itoa(queue) {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-done:
			return fmt.Errorf("the controller stopped before reading queue %d: %v", queue, err)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// rules: upstream's postrouting rules (controller.go, syncNFTablesRules), as iptables rules.
func rules(chain, podCIDR string, queue int) [][]string {
	q := []string{"-j", "NFQUEUE", "--queue-num", strconv.Itoa(queue)}
	return [][]string{
		{"-A", chain, "-p", "udp", "--dport", "53", "-j", "RETURN"},
		{"-A", chain, "-m", "owner", "--uid-owner", "0", "-j", "RETURN"},
		{"-A", chain, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "RETURN"},
		append([]string{"-A", chain, "-s", podCIDR}, q...),
		append([]string{"-A", chain, "-d", podCIDR}, q...),
	}
}

func installRules(chain string, steering [][]string) error {
	if err := iptables("-N", chain); err != nil {
		return err
	}
	for _, r := range steering {
		if err := iptables(r...); err != nil {
			return err
		}
	}
	return iptables("-A", "POSTROUTING", "-j", chain)
}

func removeRules(chain string) {
	for iptables("-D", "POSTROUTING", "-j", chain) == nil {
	}
	_ = iptables("-F", chain)
	_ = iptables("-X", chain)
}

func iptables(args ...string) error {
	out, err := exec.Command("iptables", append([]string{"-w", "-t", "mangle"}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("iptables -t mangle %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}
