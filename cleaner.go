package idempotency

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// deleteBatch deletes one batch of up to limit expired keys. Paced, as in
// a round of the cleaner, a full batch is followed by a pause of nine times
// as long as it took, which it returns, and traces with the batch.
func (s *Store) deleteBatch(ctx context.Context, limit int, paced bool) (deleted int64, pause time.Duration, err error) {
	start := time.Now()
	var tag pgconn.CommandTag
	st, err := s.statements(ctx)
	if err == nil {
		err = s.readCommitted(ctx, func(tx pgx.Tx) (err error) {
			tag, err = tx.Exec(ctx, st.deleteExpired, limit)
			return err
		})
	}
	if err != nil {
		err = s.dbError(ctx, "delete expired keys", err)
	}
	took := time.Since(start)
	if paced && err == nil && tag.RowsAffected() >= int64(limit) {
		pause = max(9*took, time.Microsecond) // never zero: zero says the round is over
	}
	if g, ok := s.opts.tracer.(*guardedTracer); ok {
		g.cleanerBatch(ctx, TraceCleanerBatchData{Deleted: tag.RowsAffected(), Duration: took, Pause: pause, Err: err})
	}
	return tag.RowsAffected(), pause, err
}

// DeleteExpired deletes every expired key, in batches of batchSize, as
// one round of [Store.RunCleaner] does: batches until one comes back short,
// and between two batches a pause of nine times as long as the last one
// took, so that it spends at most a tenth of its time deleting and never
// competes hard with the calls the store serves, however large the backlog
// (after downtime, or a TTL shortened). It returns how many keys it
// deleted, with the error of the batch that failed, or ctx's if ctx was
// done during a pause. A tracer that is a [CleanerTracer] sees each batch,
// and the pause after it. Cleaners on several replicas may run at once: a
// batch only ever deletes keys that are expired when it runs.
func (s *Store) DeleteExpired(ctx context.Context, batchSize int) (int64, error) {
	if batchSize <= 0 {
		return 0, fmt.Errorf("idempotency: DeleteExpired: batch size must be positive, got %d", batchSize)
	}
	var total int64
	for {
		n, pause, err := s.deleteBatch(ctx, batchSize, true)
		total += n
		if err != nil || pause == 0 {
			return total, err
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return total, ctx.Err()
		case <-t.C:
		}
	}
}

// RunCleaner deletes expired keys every interval, in batches of batchSize,
// until ctx is done; then it returns ctx's error. Errors from single rounds
// are passed to onError when it is not nil, and the cleaner keeps going.
// Run it in its own goroutine; one per replica is fine.
//
// Each round is a [Store.DeleteExpired]: while a backlog lasts, it
// pauses between batches for nine times as long as the last batch took.
func (s *Store) RunCleaner(ctx context.Context, interval time.Duration, batchSize int, onError func(error)) error {
	if interval <= 0 || batchSize <= 0 {
		return fmt.Errorf("idempotency: RunCleaner: interval and batch size must be positive, got %v and %d", interval, batchSize)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		if _, err := s.DeleteExpired(ctx, batchSize); err != nil && ctx.Err() == nil && onError != nil {
			onError(err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
