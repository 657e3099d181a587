package idempotencykafka_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Two Consumers of one client: X Runs, Y is a poll loop of the
// application's own (PollRecords, ProcessFetches, AllowRebalance), as an
// application with a second handler might write it. Run refuses a second
// Run on the client for this very reason ("each would commit offsets past
// records the other has not applied yet"); is a ProcessFetches beside a
// Run refused too?
//
// X's poll takes m-0..m-9 and is stuck on m-0 (a slow downstream call);
// Y's poll takes m-10..m-19, applies them and commits offset 20. X is then
// stopped before m-0 is applied. The group's committed offset must not be
// past a record nobody applied: either Y is refused, or nothing is
// committed past m-0.
func TestReview30eProcessFetchesBesideARunOnOneClient(t *testing.T) {
	t.Parallel()
	const group, n = "run-and-loop", 20
	w := newWorld(t, 1, "credits")
	w.produce(t, "credits", amounts(n)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, "credits")...)
	require.NoError(t, err)
	defer client.Close()

	stuck := make(chan struct{})
	var stuckOnce bool
	slow := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if header(r, idempotencykafka.DefaultIDHeader) == "m-0" {
			if !stuckOnce {
				stuckOnce = true
				close(stuck)
			}
			<-ctx.Done()
			return ctx.Err()
		}
		return credit(ctx, tx, r)
	}
	x, err := idempotencykafka.New(w.store, client, slow, idempotencykafka.WithMaxPollRecords(10))
	require.NoError(t, err)
	y, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- x.Run(ctx) }()
	<-stuck

	pctx, pcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer pcancel()
	fetches := pollRecords(t, client, 1)
	yErr := y.ProcessFetches(pctx, fetches)
	client.AllowRebalance()
	t.Logf("Y's poll: %d records from offset %d; ProcessFetches: %v", len(fetches.Records()), fetches.Records()[0].Offset, yErr)

	cancel()
	require.True(t, errors.Is(<-done, context.Canceled))

	committed := w.committed(t, group, "credits")
	var below int
	require.NoError(t, w.db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM credits WHERE msg_id = ANY($1)`, idsBelow(committed)).Scan(&below))
	rows, _ := w.credits(t)
	t.Logf("committed offset %d; %d effects in all, %d of the records below the committed offset", committed, rows, below)
	assert.EqualValues(t, committed, below, "every record below the committed offset was applied (promise 2)")
}

func idsBelow(offset int64) []string {
	var ids []string
	for i := range offset {
		ids = append(ids, fmt.Sprintf("m-%d", i))
	}
	return ids
}
