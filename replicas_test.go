package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/faultproxy"
)

const (
	replicaCount   = 3
	replicaCalls   = 300
	replicaWorkers = 6
	replicaDrop    = 0.25
)

// replicaLog records, per key, which replica saw each attempt and which
// one executed it.
type replicaLog struct {
	mu       sync.Mutex
	attempts map[string]map[string]int // key -> replica -> attempts
	executor map[string]string         // key -> replica that committed it
	replayBy map[string]map[string]bool
}

func (l *replicaLog) interceptor(name string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		key := metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)[0]
		l.mu.Lock()
		if l.attempts[key] == nil {
			l.attempts[key] = map[string]int{}
		}
		l.attempts[key][name]++
		l.mu.Unlock()
		return h(ctx, req)
	}
}

func (l *replicaLog) outcomes(name string) idempotency.Tracer {
	return endTracer(func(ctx context.Context, data idempotency.TraceCallEndData) {
		o, key := data.Outcome, data.Key
		l.mu.Lock()
		defer l.mu.Unlock()
		switch o {
		case idempotency.OutcomeExecuted:
			l.executor[key] = name
		case idempotency.OutcomeReplayed:
			if l.replayBy[key] == nil {
				l.replayBy[key] = map[string]bool{}
			}
			l.replayBy[key][name] = true
		}
	})
}

// Three replicas share one database behind a round-robin client, each
// behind a proxy that loses a quarter of its responses after the commit, so
// calls are retried and the retries land on other replicas. One replica is
// stopped mid-load and comes back at a new address. Every logical call
// executes exactly once, and replicas other than the executor answer
// retries from the shared table.
func TestReplicasShareKeysAndSurviveARestart(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	log := &replicaLog{attempts: map[string]map[string]int{}, executor: map[string]string{}, replayBy: map[string]map[string]bool{}}
	var mu sync.Mutex
	var started []*replica // every replica ever started, with its proxy
	var proxies []*faultproxy.Proxy
	start := func(name string, seed int64) (*replica, string) {
		r := startReplica(t, schemaPool(t, db.Schema, 6, nil), replicaConfig{
			interceptors: []grpc.UnaryServerInterceptor{log.interceptor(name)},
			tracer:       log.outcomes(name),
			// A retry that finds its call still running on a stopped
			// replica waits for it, however slowly that one ends.
			storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(liveness)},
		})
		p, err := faultproxy.New(r.addr, faultproxy.WithSeed(seed), faultproxy.WithDropResponseRate(replicaDrop))
		require.NoError(t, err)
		t.Cleanup(func() { _ = p.Close() })
		mu.Lock()
		started = append(started, r)
		proxies = append(proxies, p)
		mu.Unlock()
		return r, p.Addr()
	}
	replicas := make([]*replica, replicaCount)
	addrs := make([]resolver.Address, replicaCount)
	for i := range replicas {
		var addr string
		replicas[i], addr = start(fmt.Sprintf("replica-%d", i), int64(i))
		addrs[i] = resolver.Address{Addr: addr}
	}
	res := manual.NewBuilderWithScheme("replicas")
	res.InitialState(resolver.State{Addresses: addrs})
	conn, attempts := retryingClient(t, res.Scheme()+":///ledger", 20, grpc.WithResolvers(res),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig":[{"round_robin":{}}]}`))

	var done, retries, appRetries atomic.Int64
	restarted := make(chan struct{})
	go func() {
		defer close(restarted)
		for done.Load() < replicaCalls/3 {
			time.Sleep(time.Millisecond)
		}
		// Replica 1 stops with calls in flight and comes back at a new
		// address, as a restarted pod would.
		replicas[1].srv.Stop()
		var addr string
		replicas[1], addr = start("replica-1-restarted", 11)
		addrs[1] = resolver.Address{Addr: addr}
		res.UpdateState(resolver.State{Addresses: addrs})
	}()
	runLogical(t, replicaCalls, replicaWorkers, func(ctx context.Context, i int) (*wrapperspb.StringValue, error) {
		defer done.Add(1)
		if i >= 2*replicaCalls/3 { // the last third runs with the restarted replica
			<-restarted
		}
		return chargeUntilDone(ctx, conn, i, &retries, &appRetries)
	})
	<-restarted

	e := &env{t: t, db: db}
	require.Empty(t, e.exactlyOnce(replicaCalls))
	requireKeysMatchLedger(t, db)
	attempts.requireOnlyFailures(t, codes.Unavailable)

	log.mu.Lock()
	defer log.mu.Unlock()
	perReplica := map[string]int{}
	spread, replayedElsewhere := 0, 0
	for key, by := range log.attempts {
		for name, n := range by {
			perReplica[name] += n
		}
		if len(by) > 1 {
			spread++
		}
		for name := range log.replayBy[key] {
			if name != log.executor[key] {
				replayedElsewhere++
				break
			}
		}
	}
	require.Positive(t, spread, "retries of one call reach different replicas")
	require.Positive(t, replayedElsewhere, "a replica answers a retry of a call another replica executed")
	require.Positive(t, perReplica["replica-1-restarted"], "the restarted replica takes calls again")
	var dropped, acked int64
	mu.Lock()
	for i, p := range proxies {
		dropped += p.Stats().ResponsesDropped
		acked += started[i].execs.Load()
	}
	mu.Unlock()
	failed, byCode := attempts.failures()
	t.Logf("replicas: %d logical calls over %d replicas (one restarted mid-load), attempts per replica %v, %d responses dropped after commit, %d attempts failed (%s), %d retries by the interceptor, %d by the application, %d keys reached 2+ replicas, %d replayed by a replica other than the executor, %d executions (%d of them reported committed by their replica), 0 duplicates",
		replicaCalls, replicaCount, perReplica, dropped, failed, byCode, retries.Load(), appRetries.Load(), spread, replayedElsewhere, e.ledgerRows(), acked)
}
