package idempotencykafka_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
	"github.com/exactlyonce/idempotency/internal/crashproc"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(crashproc.Main(runChild))
	}
	os.Exit(testdb.RunWithLeakCheck(m))
}

// consumerOpts are a group consumer's, as the helper wants them, with
// short group timeouts so that tests rebalance in seconds.
func consumerOpts(brokers []string, group, topic string, extra ...kgo.Opt) []kgo.Opt {
	return append([]kgo.Opt{
		kgo.SeedBrokers(brokers...),
		kgo.ConsumerGroup(group),
		kgo.ConsumeTopics(topic),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.SessionTimeout(3 * time.Second),
		kgo.HeartbeatInterval(200 * time.Millisecond),
		kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(),
		kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked),
	}, extra...)
}

// credit is the handler: the value is an amount of cents; "oops" is a
// poison record, "fail" fails every time (what follows it is quoted in the
// error), "panic" panics every time,
// "downstream-aborted" and "downstream-exhausted" fail as a downstream
// gRPC call does, "ref:X" credits against a reference that must exist when the transaction
// commits, "lock" credits 1 cent after locking the 'known' reference, with
// a lock timeout of 50 ms.
func credit(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
	v := string(r.Value)
	switch {
	case strings.HasPrefix(v, "fail"):
		return errors.New("the ledger refuses this record today" + strings.TrimPrefix(v, "fail"))
	case v == "panic":
		panic("the handler cannot read " + v)
	case v == "downstream-aborted":
		return status.Error(codes.Aborted, "the provider aborted the charge")
	case v == "downstream-exhausted":
		return status.Error(codes.ResourceExhausted, "the provider's quota is used up")
	case v == "lock":
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '50ms'`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE refs SET id = id WHERE id = 'known'`); err != nil {
			return err
		}
		v = "1"
	case strings.HasPrefix(v, "ref:"):
		_, err := tx.Exec(ctx, `INSERT INTO credits (msg_id, account, cents, ref) VALUES ($1, $2, 1, $3)`, header(r, idempotencykafka.DefaultIDHeader), string(r.Key), strings.TrimPrefix(v, "ref:"))
		return err
	}
	cents, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return idempotency.Final(fmt.Errorf("value %q is not an amount: %w", v, err))
	}
	_, err = tx.Exec(ctx, `INSERT INTO credits (msg_id, account, cents) VALUES ($1, $2, $3)`, header(r, idempotencykafka.DefaultIDHeader), string(r.Key), cents)
	return err
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// world is a broker, a database with the credits table (no unique
// constraint on msg_id, so that a duplicate effect would show), and a store.
//
// Its sessions commit without waiting for the WAL flush
// (synchronous_commit off): a test applies thousands of records one after
// another, each a commit, and a flush waits for a disk that the tests
// beside it, and other clients of the server, keep busy (60 ms a commit
// made a test of 3,200 records take more than 3 minutes). What a commit
// makes visible is the same; only a crash of the server, which no test
// here causes, could lose it.
type world struct {
	cluster *kfake.Cluster
	brokers []string
	db      *testdb.DB
	store   *idempotency.Store
	admin   *kadm.Client
}

func newWorld(t testing.TB, partitions int32, topics ...string) *world {
	t.Helper()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topics...), kfake.GroupMinSessionTimeout(500*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(cluster.Close)
	w := &world{cluster: cluster, brokers: cluster.ListenAddrs(), db: testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	})}
	w.store, err = idempotency.NewStore(w.db.Pool)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, w.store.Migrate(ctx))
	_, err = w.db.Pool.Exec(ctx, `
CREATE TABLE refs (id text PRIMARY KEY);
INSERT INTO refs VALUES ('known');
CREATE TABLE credits (
    id      bigserial PRIMARY KEY,
    msg_id  text NOT NULL,
    account text NOT NULL,
    cents   bigint NOT NULL,
    ref     text REFERENCES refs DEFERRABLE INITIALLY DEFERRED
)`)
	require.NoError(t, err)
	admin, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...))
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	w.admin = kadm.NewClient(admin)
	return w
}

// dbURL is the URL of the world's database for a consumer process of the
// test's own, whose sessions commit as the world's do.
func (w *world) dbURL() string { return w.db.URL() + "&synchronous_commit=off" }

// produce sends records, each with its message-id header, and waits for
// the broker to have them.
func (w *world) produce(t testing.TB, topic string, records ...*kgo.Record) {
	t.Helper()
	p, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.RoundRobinPartitioner()))
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.ProduceSync(context.Background(), records...).FirstErr())
}

func rec(id, key, value string) *kgo.Record {
	return &kgo.Record{Key: []byte(key), Value: []byte(value), Headers: []kgo.RecordHeader{{Key: idempotencykafka.DefaultIDHeader, Value: []byte(id)}}}
}

func amounts(n int) []*kgo.Record { return amountsFrom(0, n) }

// amountsFrom is n records of amounts, with the message IDs from m-<from>.
func amountsFrom(from, n int) []*kgo.Record {
	rs := make([]*kgo.Record, n)
	for i := range rs {
		j := from + i
		rs[i] = rec(fmt.Sprintf("m-%d", j), fmt.Sprintf("acct-%d", j%5), strconv.Itoa(j%100+1))
	}
	return rs
}

// committed is the group's committed offsets on topic, summed over its
// partitions: the number of records it will not see again.
func (w *world) committed(t testing.TB, group, topic string) int64 {
	t.Helper()
	var n int64
	for _, at := range w.committedByPartition(t, group, topic) {
		n += at
	}
	return n
}

// committedByPartition is the group's committed offset of each of topic's
// partitions that has one.
func (w *world) committedByPartition(t testing.TB, group, topic string) map[int32]int64 {
	t.Helper()
	at := map[int32]int64{}
	offsets, err := w.admin.FetchOffsets(context.Background(), group)
	if err != nil {
		return at // the group's coordinator is not ready yet
	}
	offsets.Each(func(o kadm.OffsetResponse) {
		if o.Topic == topic && o.Err == nil {
			at[o.Partition] = o.At
		}
	})
	return at
}

// credits is how many effects committed, and how many distinct records
// they came from.
func (w *world) credits(t testing.TB) (rows, distinct int) {
	t.Helper()
	require.NoError(t, w.db.Pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT msg_id) FROM credits`).Scan(&rows, &distinct))
	return rows, distinct
}

// waitFor waits until done, for at most 3 minutes.
func waitFor(t *testing.T, what string, done func() bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for !done() {
		if time.Now().After(deadline) {
			t.Fatalf("not reached in 3 minutes: %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitForCount waits until count reaches want, for as long as it moves:
// it fails once count has not moved for 3 minutes. Thousands of records
// take what the machine gives them (each is round trips to PostgreSQL and
// the broker, one after another), which no fixed time bounds; a consumer
// that stops making progress fails all the same.
func waitForCount(t *testing.T, what string, want int64, count func() int64) {
	t.Helper()
	at, moved := count(), time.Now()
	for at < want {
		if time.Since(moved) > 3*time.Minute {
			t.Fatalf("no progress in 3 minutes, at %d of %d: %s", at, want, what)
		}
		time.Sleep(50 * time.Millisecond)
		if n := count(); n != at {
			at, moved = n, time.Now()
		}
	}
}

// pollRecords polls client until it has at least n records, as a poll
// loop of one's own does (see ProcessFetches): it wakes the client's fetch
// loops before each poll, which waits a second at most, and allows the
// rebalance an empty poll held while it holds no records.
func pollRecords(t *testing.T, client *kgo.Client, n int) kgo.Fetches {
	t.Helper()
	var fetches kgo.Fetches
	deadline := time.Now().Add(3 * time.Minute)
	for len(fetches.Records()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d records polled in 3 minutes", len(fetches.Records()), n)
		}
		client.ResumeFetchTopics()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		f := client.PollRecords(ctx, 10)
		cancel()
		if f.NumRecords() > 0 {
			fetches = append(fetches, f...)
		} else if len(fetches) == 0 {
			client.AllowRebalance()
		}
	}
	return fetches
}

// applied is how many effects committed so far, for waitForCount.
func (w *world) applied(t testing.TB) func() int64 {
	return func() int64 { rows, _ := w.credits(t); return int64(rows) }
}

// committedOf is the group's committed offsets on topic, summed, for
// waitForCount.
func (w *world) committedOf(t testing.TB, group, topic string) func() int64 {
	return func() int64 { return w.committed(t, group, topic) }
}

// member is a consumer of the group running in this process.
type member struct {
	client             *kgo.Client
	executed, replayed atomic.Int64
	inProgress         atomic.Int64
	assigned           atomic.Int64 // partitions the group gave it, over time
	consumer           *idempotencykafka.Consumer
	stop               func()
}

func (w *world) startMember(t *testing.T, group, topic string, opts ...idempotencykafka.Option) *member {
	t.Helper()
	return w.startMemberOn(t, w.store, group, topic, opts...)
}

func (w *world) startMemberOn(t *testing.T, store *idempotency.Store, group, topic string, opts ...idempotencykafka.Option) *member {
	t.Helper()
	return w.startMemberWith(t, memberConfig{store: store}, group, topic, opts...)
}

// memberConfig is what a member of a test may change: the store, options
// of its client, and a hook told of each record's outcome after the
// member counted it, before the record's offset is committed.
type memberConfig struct {
	store     *idempotency.Store
	client    []kgo.Opt
	onOutcome func(idempotency.Outcome)
}

func (w *world) startMemberWith(t *testing.T, cfg memberConfig, group, topic string, opts ...idempotencykafka.Option) *member {
	t.Helper()
	m := &member{}
	var err error
	m.client, err = kgo.NewClient(consumerOpts(w.brokers, group, topic, append([]kgo.Opt{kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, ps map[string][]int32) {
		for _, p := range ps {
			m.assigned.Add(int64(len(p)))
		}
	})}, cfg.client...)...)...)
	require.NoError(t, err)
	count := idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
		defer func() {
			if cfg.onOutcome != nil {
				cfg.onOutcome(o)
			}
		}()
		switch o {
		case idempotency.OutcomeExecuted:
			m.executed.Add(1)
		case idempotency.OutcomeReplayed:
			m.replayed.Add(1)
		case idempotency.OutcomeInProgress:
			m.inProgress.Add(1)
		}
	})
	c, err := idempotencykafka.New(cfg.store, m.client, credit, append([]idempotencykafka.Option{count}, opts...)...)
	require.NoError(t, err)
	m.consumer = c
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	m.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
			m.client.Close()
		})
	}
	t.Cleanup(m.stop)
	return m
}

// readAll reads n records of topic from its start.
func (w *world) readAll(t *testing.T, topic string, n int) []*kgo.Record {
	t.Helper()
	c, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	require.NoError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		f := c.PollFetches(ctx)
		require.NoError(t, ctx.Err(), "read %d of %d records of %s", len(out), n, topic)
		out = append(out, f.Records()...)
	}
	return out
}

// custom is a consumer of the group with a handler and client options of
// the test's own, running until the test ends or stop is called.
type custom struct {
	client   *kgo.Client
	consumer *idempotencykafka.Consumer
	stop     func()
}

func (w *world) startCustom(t *testing.T, store *idempotency.Store, group, topic string, handle idempotencykafka.Handler, clientOpts []kgo.Opt, opts ...idempotencykafka.Option) *custom {
	t.Helper()
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, topic, clientOpts...)...)
	require.NoError(t, err)
	return runCustom(t, store, client, handle, opts...)
}

// runCustom runs a consumer on a client the test built.
func runCustom(t *testing.T, store *idempotency.Store, client *kgo.Client, handle idempotencykafka.Handler, opts ...idempotencykafka.Option) *custom {
	t.Helper()
	c, err := idempotencykafka.New(store, client, handle, opts...)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	m := &custom{client: client, consumer: c}
	m.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
			client.Close()
		})
	}
	t.Cleanup(m.stop)
	return m
}

// refuseCommits makes the broker answer the group's offset commits with
// code while refuse, asked once per commit, says so.
func refuseCommits(cluster *kfake.Cluster, group string, code int16, refuse func() bool) {
	refuseCommitsOf(cluster, group, code, func(*kmsg.OffsetCommitRequest) bool { return refuse() })
}

// refuseCommitsOf is refuseCommits with refuse told which commit it is
// asked about.
func refuseCommitsOf(cluster *kfake.Cluster, group string, code int16, refuse func(*kmsg.OffsetCommitRequest) bool) {
	answerCommits(cluster, group, func(req *kmsg.OffsetCommitRequest) int16 {
		if refuse(req) {
			return code
		}
		return 0
	})
}

// answerCommits makes the broker answer each of the group's offset
// commits with the error code answer gives it, for every partition; 0
// lets the broker handle the commit.
func answerCommits(cluster *kfake.Cluster, group string, answer func(*kmsg.OffsetCommitRequest) int16) {
	cluster.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		commit := req.(*kmsg.OffsetCommitRequest)
		if commit.Group != group {
			return nil, nil, false
		}
		code := answer(commit)
		if code == 0 {
			return nil, nil, false
		}
		resp := commit.ResponseKind().(*kmsg.OffsetCommitResponse)
		for _, topic := range commit.Topics {
			rt := kmsg.NewOffsetCommitResponseTopic()
			rt.Topic = topic.Topic
			for _, p := range topic.Partitions {
				rp := kmsg.NewOffsetCommitResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
}

// once returns a refuse function for refuseCommits that refuses the first
// commit, and counts the commits asked about in n.
func once(n *atomic.Int64) func() bool { return func() bool { return n.Add(1) == 1 } }

// fenceHeartbeats makes the broker answer the group's heartbeats with
// UNKNOWN_MEMBER_ID while fenced is set: franz-go then reports the
// member's partitions lost.
func fenceHeartbeats(cluster *kfake.Cluster, group string, fenced *atomic.Bool) {
	cluster.ControlKey(kmsg.Heartbeat.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		hb := req.(*kmsg.HeartbeatRequest)
		if hb.Group != group || !fenced.Load() {
			return nil, nil, false
		}
		resp := hb.ResponseKind().(*kmsg.HeartbeatResponse)
		resp.ErrorCode = kerr.UnknownMemberID.Code
		return resp, nil, true
	})
}

// failDescribeConfigsOnce makes the broker time out the first
// DescribeConfigs request; failed says it did.
func failDescribeConfigsOnce(cluster *kfake.Cluster) (failed *atomic.Bool) {
	failed = new(atomic.Bool)
	cluster.ControlKey(kmsg.DescribeConfigs.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		if !failed.CompareAndSwap(false, true) {
			return nil, nil, false
		}
		dc := req.(*kmsg.DescribeConfigsRequest)
		resp := dc.ResponseKind().(*kmsg.DescribeConfigsResponse)
		for _, r := range dc.Resources {
			rr := kmsg.NewDescribeConfigsResponseResource()
			rr.ResourceType, rr.ResourceName = r.ResourceType, r.ResourceName
			rr.ErrorCode = kerr.RequestTimedOut.Code
			resp.Resources = append(resp.Resources, rr)
		}
		return resp, nil, true
	})
	return failed
}

// end is the end offset of topic's partition 0.
func (w *world) end(t testing.TB, topic string) int64 { return w.ends(t, topic)[0] }

// ends is the end offset of each of topic's partitions.
func (w *world) ends(t testing.TB, topic string) map[int32]int64 {
	t.Helper()
	ends, err := w.admin.ListEndOffsets(context.Background(), topic)
	require.NoError(t, err)
	at := map[int32]int64{}
	ends.Each(func(o kadm.ListedOffset) { at[o.Partition] = o.Offset })
	return at
}

// commitRequests counts the group's OffsetCommit requests and the most
// partitions one of them carried, letting every request through.
func commitRequests(cluster *kfake.Cluster, group string) (requests, widest *atomic.Int64) {
	requests, widest = new(atomic.Int64), new(atomic.Int64)
	cluster.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		commit := req.(*kmsg.OffsetCommitRequest)
		if commit.Group == group {
			requests.Add(1)
			n := int64(0)
			for _, t := range commit.Topics {
				n += int64(len(t.Partitions))
			}
			if n > widest.Load() {
				widest.Store(n)
			}
		}
		return nil, nil, false
	})
	return requests, widest
}

// thirtyDays sets topic's retention.ms to 30 days: a group that re-reads it
// (its offsets expired after the brokers' 7 days) reads records 37 days old.
func (w *world) thirtyDays(t *testing.T, topic string) {
	t.Helper()
	ms := "2592000000"
	_, err := w.admin.AlterTopicConfigs(context.Background(), []kadm.AlterConfig{{Name: "retention.ms", Value: &ms}}, topic)
	require.NoError(t, err)
}

// logTTL logs how long the keys are kept.
func (w *world) logTTL(t *testing.T) {
	t.Helper()
	var ttl string
	require.NoError(t, w.db.Pool.QueryRow(context.Background(), `SELECT (max(expires_at - created_at))::text FROM idempotency_keys`).Scan(&ttl))
	t.Logf("the keys are kept %s", ttl)
}

// passDays makes the world days older: the IDs' expiry (the store forgets
// an ID whose expires_at has passed) and their creation move back.
func (w *world) passDays(t *testing.T, days int) {
	t.Helper()
	_, err := w.db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET expires_at = expires_at - make_interval(days => $1), created_at = created_at - make_interval(days => $1)`, days)
	require.NoError(t, err)
}

// runCustomConsumer runs c on client until the returned function stops
// it and closes the client.
func runCustomConsumer(t *testing.T, client *kgo.Client, c *idempotencykafka.Consumer) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
			client.Close()
		})
	}
	t.Cleanup(stop)
	return stop
}

// createApplied creates the table applied: which group applied which
// record ID, as the handlers of applyAs write it.
func (w *world) createApplied(t *testing.T) {
	t.Helper()
	_, err := w.db.Pool.Exec(context.Background(), `CREATE TABLE applied (grp text NOT NULL, msg_id text NOT NULL)`)
	require.NoError(t, err)
}

// applyAs is a handler of group: it writes the record's ID (its
// DefaultIDHeader) to applied, or, while refuse (nil: never) says so,
// refuses the record with a final error: the record is dead-lettered.
func applyAs(group string, refuse func() bool) idempotencykafka.Handler {
	return func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if refuse != nil && refuse() {
			return idempotency.Final(errors.New("group " + group + " refuses it"))
		}
		_, err := tx.Exec(ctx, `INSERT INTO applied VALUES ($1, $2)`, group, header(r, idempotencykafka.DefaultIDHeader))
		return err
	}
}

// holdID applies r through store as another holder of its ID would (the
// member that had r's partition before a rebalance, still applying it):
// it returns once the ID is held, and holds it until release is called;
// held then gets the holder's error. The ID is released when the test ends
// at the latest.
func (w *world) holdID(t *testing.T, store *idempotency.Store, group, topic string, r *kgo.Record) (release func(), held <-chan error) {
	t.Helper()
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, topic)...)
	require.NoError(t, err)
	probe, err := idempotencykafka.New(store, client, credit)
	require.NoError(t, err)
	msg, err := probe.Message(context.Background(), r)
	require.NoError(t, err)
	client.Close()
	holding, releasing := make(chan struct{}), make(chan struct{})
	result := make(chan error, 1)
	go func() {
		_, err := store.ProcessMessage(context.Background(), msg, func(ctx context.Context, tx pgx.Tx) error {
			close(holding)
			<-releasing
			return credit(ctx, tx, r)
		})
		result <- err
	}()
	<-holding
	var once sync.Once
	release = func() { once.Do(func() { close(releasing) }) }
	t.Cleanup(release)
	return release, result
}
