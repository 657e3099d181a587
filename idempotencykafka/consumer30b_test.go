package idempotencykafka_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// refuseCommits makes the broker refuse the group's offset commits while
// refuse is set.
func refuseCommits(cluster *kfake.Cluster, group string, refuse *atomic.Bool) {
	cluster.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		cluster.KeepControl()
		commit := req.(*kmsg.OffsetCommitRequest)
		if commit.Group != group || !refuse.Load() {
			return nil, nil, false
		}
		resp := commit.ResponseKind().(*kmsg.OffsetCommitResponse)
		for _, topic := range commit.Topics {
			rt := kmsg.NewOffsetCommitResponseTopic()
			rt.Topic = topic.Topic
			for _, p := range topic.Partitions {
				rp := kmsg.NewOffsetCommitResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.OffsetMetadataTooLarge.Code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
}

// end is the end offset of topic's partition 0.
func (w *world) end(t testing.TB, topic string) int64 {
	t.Helper()
	ends, err := w.admin.ListEndOffsets(context.Background(), topic)
	require.NoError(t, err)
	o, _ := ends.Lookup(topic, 0)
	return o.Offset
}

// It failed when giving up on a record was not stored: R failed its
// attempts and was dead-lettered, S after it was applied, the offset
// commit did not get through before the consumer stopped, R's cause went
// away, and the next consumer applied R, after S. Giving up is stored as
// the ID's final error: the next consumer dead-letters R again and never
// applies it.
func TestGivenUpRecordIsNotAppliedAfterLaterRecords(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	var refuse atomic.Bool
	refuse.Store(true)
	refuseCommits(w.cluster, "order-group", &refuse)
	// R credits against a reference that does not exist yet: it fails at
	// COMMIT, the handler's failure, until the reference is there.
	w.produce(t, "payments", rec("r", "acct-1", "ref:later"), rec("s", "acct-1", "100"))
	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	first := w.startMember(t, "order-group", "payments", idempotencykafka.WithMaxAttempts(2), backoff)
	waitFor(t, "R dead-lettered and S applied", func() bool {
		rows, _ := w.credits(t)
		return rows == 1 && w.end(t, "payments.dead-letter") == 1
	})
	first.stop()
	require.Zero(t, w.committed(t, "order-group", "payments"), "no offset got through")

	refuse.Store(false)
	_, err := w.db.Pool.Exec(context.Background(), `INSERT INTO refs VALUES ('later')`)
	require.NoError(t, err)
	var rOutcomes []idempotency.Outcome
	second := w.startMemberWith(t, memberConfig{store: w.store}, "order-group", "payments", backoff,
		idempotencykafka.WithOutcomeHandler(func(r *kgo.Record, o idempotency.Outcome, _ error) {
			if header(r, idempotencykafka.DefaultIDHeader) == "r" {
				rOutcomes = append(rOutcomes, o)
			}
		}))
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "order-group", "payments") == 2 })
	second.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "R is not applied after S")
	require.Equal(t, []idempotency.Outcome{idempotency.OutcomeReplayed}, rOutcomes, "R's stored give-up is replayed")
	dl := w.readAll(t, "payments.dead-letter", 2)
	require.Contains(t, header(dl[1], idempotencykafka.HeaderCause), "gave up after 2 attempts")
}
