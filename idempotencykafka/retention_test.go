package idempotencykafka_test

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// setRetention sets topic's retention.ms.
func (w *world) setRetention(t *testing.T, topic string, d time.Duration) {
	t.Helper()
	ms := strconv.FormatInt(d.Milliseconds(), 10)
	_, err := w.admin.AlterTopicConfigs(context.Background(), []kadm.AlterConfig{{Name: "retention.ms", Value: &ms}}, topic)
	require.NoError(t, err)
}

// testClock is a consumer's clock that a test moves on instead of waiting.
type testClock struct{ ahead atomic.Int64 }

func (c *testClock) now() time.Time { return time.Now().Add(time.Duration(c.ahead.Load())) }

// pass moves the clock d on.
func (c *testClock) pass(d time.Duration) { c.ahead.Add(int64(d)) }

// A consumer runs on payments, whose retention.ms is an hour: it keeps
// IDs 14 days and an hour (the hour, segment.ms's 7 days, the offsets' 7).
// An operator raises the topic to 30 days with AlterTopicConfigs; three
// records are produced and applied. Fifteen days later (the IDs' expiry
// moved back) the group is reset to the earliest offset with kadm, as an
// operator does, and reads the three records again: the topic keeps them
// 30 days.
//
// Before the fix: the consumer read the topic's configs once, at the
// start, and gave the three records' IDs 14 days where 44 are needed
// (30 days, a segment's 7, the offsets' 7): the reset group finds them
// forgotten and applies the records again, 6 effects.
//
// Now: configs read a minute ago (the clock moved on instead of waiting)
// are read again before a record's TTL is computed from them: the IDs
// outlast the raised retention, and the reset group replays the records.
func TestRetentionRaisedWhileTheConsumerRunsIsSeen(t *testing.T) {
	t.Parallel()
	const group, topic = "raised", "payments"
	w := newWorld(t, 1, topic)
	w.setRetention(t, topic, time.Hour)
	clock := &testClock{}
	var replayed atomic.Int64
	opts := []idempotencykafka.Option{idempotencykafka.WithClock(clock.now), idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
		if o == idempotency.OutcomeReplayed {
			replayed.Add(1)
		}
	})}
	m := w.startCustom(t, w.store, group, topic, credit, nil, opts...)
	require.NoError(t, m.consumer.CheckRetention(context.Background()), "the consumer knows the topic's hour")

	w.setRetention(t, topic, 30*24*time.Hour)
	clock.pass(idempotencykafka.RetentionRefresh)
	w.produce(t, topic, amounts(3)...)
	waitFor(t, "the three records applied", func() bool { return w.committed(t, group, topic) == 3 })
	m.stop()
	w.logTTL(t)
	assert.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '43 days'`),
		"the IDs outlast the raised retention (30 days), a segment's 7 days and the offsets' 7")

	w.passDays(t, 15)
	_, err := w.admin.CommitOffsets(context.Background(), group, kadm.Offsets{topic: {0: kadm.Offset{Topic: topic, Partition: 0, At: 0, LeaderEpoch: -1}}})
	require.NoError(t, err, "the group reset to the earliest offset")
	require.Zero(t, w.committed(t, group, topic))
	again := w.startCustom(t, w.store, group, topic, credit, nil, opts...)
	waitFor(t, "the three records read again", func() bool { return w.committed(t, group, topic) == 3 })
	again.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 3, distinct)
	require.Equal(t, 3, rows, "each record applied once (replayed: %d)", replayed.Load())
}

// A consumer with WithTTL(20 days) runs on payments, whose retention.ms
// is an hour (the IDs need 14 days and an hour). An operator raises the
// topic to 30 days; three records are produced.
//
// Before the fix: the consumer applies them with IDs kept 20 days where 44
// are needed, and runs on, saying nothing.
//
// Now: the raise is seen before the records are applied (the clock moved
// past the configs' minute), and the TTL is refused as it is at the start:
// Run returns an error that names the topic, its retention, the TTL and
// what to set; no record is applied, no offset committed.
func TestWithTTLMadeTooShortByARaiseStopsRun(t *testing.T) {
	t.Parallel()
	const group, topic = "raised-ttl", "payments"
	w := newWorld(t, 1, topic)
	w.setRetention(t, topic, time.Hour)
	clock := &testClock{}
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, topic)...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithTTL(20*24*time.Hour), idempotencykafka.WithClock(clock.now),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, c.CheckRetention(context.Background()), "20 days outlast the hour")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()

	w.setRetention(t, topic, 30*24*time.Hour)
	clock.pass(idempotencykafka.RetentionRefresh)
	w.produce(t, topic, amounts(3)...)
	var runErr error
	stopped := false
	waitFor(t, "Run stops, or the records are applied", func() bool {
		select {
		case runErr = <-done:
			stopped = true
		default:
		}
		return stopped || w.committed(t, group, topic) == 3
	})
	rows, _ := w.credits(t)
	require.True(t, stopped, "Run goes on after the raise (%d records applied with IDs kept 20 days)", rows)
	t.Logf("Run: %v", runErr)
	require.False(t, errors.Is(runErr, context.Canceled), "Run: %v", runErr)
	require.ErrorContains(t, runErr, "WithTTL(480h0m0s) is shorter than topic payments's retention.ms (720h0m0s)")
	require.ErrorContains(t, runErr, "set at least 1056h0m0s")
	require.Zero(t, rows, "no record applied with IDs kept too short")
	require.Zero(t, w.db.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Zero(t, w.committed(t, group, topic))
}

// payments keeps its records 7 days, its dead-letter topic 30: the IDs of
// payments need 44 days (30, a segment's 7, the offsets' 7), as a dead
// letter read back is its record. The broker does not tell the consumer
// the dead-letter topic's configs: its ACLs let the client describe
// payments but not payments.dead-letter, or the broker times the request
// out once.
//
// Before the fix: an error of the dead-letter topic's configs that kadm
// does not raise for the whole request (a timeout, a broker's failure) was
// taken for "no dead-letter topic": the three records were applied with IDs
// kept 21 days, and that TTL was used for a minute.
//
// Now: only a dead-letter topic that does not exist is left out; a read
// that failed is tried again, and the records wait for it. Configs the
// client may not read (kadm raises that for the request) refuse Run
// without WithTTL, and WithTTL stands for them with it, as before.
func TestDeadLetterTopicsConfigsThatCannotBeReadAreNotSkipped(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		err     *kerr.Error
		count   int // requests faulted, -1 for all
		opts    []idempotencykafka.Option
		refused string        // Run's error, when it refuses
		ttl     time.Duration // else: the IDs' TTL at least
	}{
		{name: "not authorized", err: kerr.TopicAuthorizationFailed, count: -1,
			refused: "TOPIC_AUTHORIZATION_FAILED"},
		{name: "not authorized, WithTTL", err: kerr.TopicAuthorizationFailed, count: -1,
			opts: []idempotencykafka.Option{idempotencykafka.WithTTL(50 * 24 * time.Hour)}, ttl: 49 * 24 * time.Hour},
		{name: "timed out once", err: kerr.RequestTimedOut, count: 1, ttl: 43 * 24 * time.Hour},
		{name: "failed twice", err: kerr.UnknownServerError, count: 2, ttl: 43 * 24 * time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			w := newWorld(t, 1, "payments", "payments.dead-letter")
			w.thirtyDays(t, "payments.dead-letter")
			w.cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.DescribeConfigs}, Resource: "payments.dead-letter", Err: tc.err, Count: tc.count})
			w.produce(t, "payments", amounts(3)...)
			client, err := kgo.NewClient(consumerOpts(w.brokers, "dlt-configs", "payments")...)
			require.NoError(t, err)
			defer client.Close()
			opts := append([]idempotencykafka.Option{idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond)}, tc.opts...)
			c, err := idempotencykafka.New(w.store, client, credit, opts...)
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			var runErr error
			stopped := false
			waitFor(t, "Run stops, or the records are applied", func() bool {
				select {
				case runErr = <-done:
					stopped = true
				default:
				}
				return stopped || w.committed(t, "dlt-configs", "payments") == 3
			})
			if !stopped {
				cancel()
				runErr = <-done
			}
			rows, _ := w.credits(t)
			t.Logf("Run: %v", runErr)
			if tc.refused != "" {
				require.True(t, stopped, "Run goes on without the dead-letter topic's configs (%d records applied)", rows)
				require.ErrorContains(t, runErr, tc.refused)
				require.Zero(t, rows, "no record applied with a TTL that leaves the dead-letter topic out")
				return
			}
			require.ErrorIs(t, runErr, context.Canceled)
			require.Equal(t, 3, rows)
			w.logTTL(t)
			require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + make_interval(secs => $1)`, tc.ttl.Seconds()),
				"the IDs outlast the dead-letter topic's 30 days, a segment's 7 and the offsets' 7")
		})
	}
}

// payments keeps its records an hour. A producer whose clock is 30 days
// ahead (or that sets its records' timestamps itself) produces R: Kafka
// deletes a record once its timestamp is past retention.ms, so it keeps R
// 30 days and an hour, where a record stamped now goes after the hour. S,
// stamped now, is produced before it. Both are applied. Fifteen days later
// (the IDs' expiry moved back 15 days, S deleted by its hour) the group is
// reset to the earliest offset and reads R again.
//
// Before the fix: R's ID was kept 14 days and an hour from when it was
// applied, as S's, and R was applied a second time.
//
// Now: a record's ID is kept for as long as its timestamp is ahead of the
// consumer's clock beyond the topic's TTL, and R is replayed.
func TestFutureTimestampedRecordsIDOutlastsIt(t *testing.T) {
	t.Parallel()
	const group, topic = "future", "payments"
	w := newWorld(t, 1, topic)
	w.setRetention(t, topic, time.Hour)
	s, r := rec("s", "acct-1", "100"), rec("r", "acct-2", "200")
	r.Timestamp = time.Now().Add(30 * 24 * time.Hour)
	w.produce(t, topic, s)
	w.produce(t, topic, r)
	m := w.startMember(t, group, topic)
	waitFor(t, "S and R applied", func() bool { return w.committed(t, group, topic) == 2 })
	m.stop()
	w.logTTL(t)

	w.passDays(t, 15)
	ctx := context.Background()
	_, err := w.admin.DeleteRecords(ctx, kadm.Offsets{topic: {0: kadm.Offset{Topic: topic, Partition: 0, At: 1}}})
	require.NoError(t, err, "S deleted by its hour of retention")
	_, err = w.admin.CommitOffsets(ctx, group, kadm.Offsets{topic: {0: kadm.Offset{Topic: topic, Partition: 0, At: 0, LeaderEpoch: -1}}})
	require.NoError(t, err, "the group reset to the earliest offset")
	again := w.startMember(t, group, topic)
	waitForCount(t, "R read again", 1, func() int64 { return again.executed.Load() + again.replayed.Load() })
	again.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 2, distinct)
	require.Equal(t, 2, rows, "R applied once (replayed: %d)", again.replayed.Load())
}

// The client may describe its topics' configs but not the brokers' (a
// cluster-level ACL applications are seldom given), and has WithTTL(2
// days); payments keeps its records 30 days, which the client can read.
//
// Before the fix: the brokers' configs refused, WithTTL was taken for the
// TTL without reading the topic's: the three records were applied with
// IDs kept 2 days, where the topic's own retention needs 37 at least.
//
// Now: WithTTL stands for the offsets' retention, which cannot be read,
// and is still held to what can: Run refuses it, naming the topic's
// retention; nothing is applied.
func TestWithTTLIsHeldToTheTopicsRetentionWhenTheBrokersConfigsAreRefused(t *testing.T) {
	t.Parallel()
	const group, topic = "broker-configs-refused", "payments"
	w := newWorld(t, 1, topic)
	w.thirtyDays(t, topic)
	w.cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.DescribeConfigs}, Resource: "0", Err: kerr.ClusterAuthorizationFailed, Count: -1})
	w.produce(t, topic, amounts(3)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, topic)...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithTTL(2*24*time.Hour))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var runErr error
	stopped := false
	waitFor(t, "Run stops, or the records are applied", func() bool {
		select {
		case runErr = <-done:
			stopped = true
		default:
		}
		return stopped || w.committed(t, group, topic) == 3
	})
	rows, _ := w.credits(t)
	require.True(t, stopped, "Run goes on with WithTTL(48h) on a topic that keeps its records 30 days (%d records applied)", rows)
	t.Logf("Run: %v", runErr)
	require.ErrorContains(t, runErr, "WithTTL(48h0m0s) is shorter than topic payments's retention.ms (720h0m0s)")
	require.Zero(t, rows)
}
