package idempotencykafka_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// It failed when a producer's message-id that is not a valid key (a space,
// "é", a NUL, 256 bytes) dead-lettered a good record unapplied, and an
// empty one was taken as an ID. Such IDs are recorded hashed, an empty one
// is no ID (the record's position identifies it), and each record is
// applied once; a redelivery of each replays.
func TestInvalidProducerIDsAreHashedAndApplied(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "credits.dead-letter")
	ids := []string{"order 1", "ordér-2", "order\x013", strings.Repeat("o", 256), ""}
	var records []*kgo.Record
	for _, id := range ids {
		records = append(records, rec(id, "acct-1", "100"))
	}
	w.produce(t, "credits", records...)
	m := w.startMember(t, "ids-group", "credits", idempotencykafka.WithDeadLetterHandler(func(r *kgo.Record, cause string) {
		t.Errorf("record %d dead-lettered: %s", r.Offset, cause)
	}))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "ids-group", "credits") == int64(len(ids)) })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, len(ids), rows, "each record applied once")
	require.EqualValues(t, len(ids), m.executed.Load())

	// Delivered again from the start, under the same scope: all replayed.
	again := w.startMember(t, "ids-group-2", "credits", idempotencykafka.WithScope("kafka/ids-group/credits"))
	waitFor(t, "every offset committed again", func() bool { return w.committed(t, "ids-group-2", "credits") == int64(len(ids)) })
	again.stop()
	rows, _ = w.credits(t)
	require.Equal(t, len(ids), rows, "no record applied twice")
	require.EqualValues(t, len(ids), again.replayed.Load())
}

// It failed when producer IDs and positions shared one namespace: a record
// whose message-id is "credits/0/0" (the position of another record) with
// the same key and value was skipped as that record's replay, and with
// another value dead-lettered as a reused key. Producer IDs that read as
// positions are recorded hashed.
func TestProducerIDsAndPositionsNeverMeet(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "credits.dead-letter")
	bare := &kgo.Record{Key: []byte("acct-1"), Value: []byte("100")} // at credits/0/0
	w.produce(t, "credits", bare, rec("credits/0/0", "acct-1", "100"), rec("credits/0/0", "acct-1", "250"), rec("position-00", "acct-1", "7"))
	m := w.startMember(t, "ns-group", "credits")
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "ns-group", "credits") == 4 })
	m.stop()
	var cents []int64
	r, err := w.db.Pool.Query(context.Background(), `SELECT cents FROM credits ORDER BY id`)
	require.NoError(t, err)
	cents, err = pgx.CollectRows(r, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Equal(t, []int64{100, 100, 7}, cents, "the bare record, the producer's credits/0/0 once (its second body is a reused ID), position-00")
}
