package idempotency

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
)

// probe looks for the key's row outside any transaction, and waits while
// its lock is held. found is true when res is the call's outcome (a
// replay, or the end of the wait); false sends the call to an attempt.
func (c *callRun) probe(ctx context.Context, w *waiter) (res result, found bool, err error) {
	for {
		start := c.tp.trace.now()
		rec, free, err := c.probeOnce(ctx)
		c.tp.trace.since(phaseClaim, start)
		switch {
		case err != nil:
			res, err := c.failed(ctx, "look up key", err)
			return res, true, err
		case rec != nil && !rec.expired && rec.state == stateRunning:
			// A claim its handler committed: settled now, whoever holds
			// the lock, since nothing can change its outcome any more.
			s, err := c.settleElsewhere(ctx, nil)
			if err != nil {
				return result{Result: Result{Outcome: outcomeOf(err)}}, true, err
			}
			res, err := c.answer(s, false, nil, nil, nil)
			return res, true, err
		case rec != nil && !rec.expired:
			res, err := c.replay(*rec)
			return res, true, err
		case free:
			return result{}, false, nil
		}
		if err := w.wait(ctx); err != nil {
			res, err := c.gaveUp(ctx)
			return res, true, err
		}
	}
}

// probeOnce reads the key's row and whether its lock is free, on a
// connection held only for that statement. Where the database's default is
// SERIALIZABLE (or REPEATABLE READ), the statement runs in a READ COMMITTED
// transaction of its own, so that conflict tracking never counts the
// engine's reads against the calls that write keys.
func (c *callRun) probeOnce(ctx context.Context) (rec *record, free bool, err error) {
	pc, err := c.s.db.Acquire(ctx)
	if err != nil {
		return nil, false, err
	}
	defer pc.Release()
	if !c.s.defaultSnapshot.Load() {
		rec, err = scanRecord(pc.QueryRow(ctx, c.st.probe, c.call.Scope, c.key), &free)
		return rec, free, err
	}
	b := &pgx.Batch{}
	b.Queue("BEGIN ISOLATION LEVEL READ COMMITTED")
	b.Queue(c.st.probe, c.call.Scope, c.key)
	b.Queue("COMMIT")
	br := pc.SendBatch(ctx, b)
	if _, err = br.Exec(); err == nil {
		if rec, err = scanRecord(br.QueryRow(), &free); err == nil {
			_, err = br.Exec()
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	return rec, free, err
}

// gaveUp ends a wait for the key's holder: the caller's own cancellation,
// or ErrInProgress once the in-progress wait is over.
func (c *callRun) gaveUp(ctx context.Context) (result, error) {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return result{Result: Result{Outcome: OutcomeCanceled}}, contextError{ctxErr}
	}
	return result{Result: Result{Outcome: OutcomeInProgress}}, inProgress("", c.s.opts.retryDelay)
}

// waiter paces a duplicate's wait for the key's holder: it sleeps, holding
// no connection, 2 ms at first, twice as long each time up to 50 ms, with
// jitter, for up to the in-progress wait counted from its first sleep.
type waiter struct {
	wait0    time.Duration // the in-progress wait
	deadline time.Time     // set by the first sleep
	pause    time.Duration
	trace    *callTrace
}

var errWaitOver = errors.New("in-progress wait is over")

func (w *waiter) wait(ctx context.Context) error {
	if w.deadline.IsZero() {
		w.deadline = time.Now().Add(w.wait0)
	}
	w.pause = min(max(2*w.pause, 2*time.Millisecond), 50*time.Millisecond)
	left := time.Until(w.deadline)
	if left <= 0 {
		return errWaitOver
	}
	d := min(time.Duration(float64(w.pause)*(0.75+0.5*rand.Float64())), left)
	defer w.trace.since(phaseWait, w.trace.now())
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
