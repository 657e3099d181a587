// Package outbox is the asynchronous way for the payments example to reach
// its provider: a transactional outbox on River (riverqueue.com). Charge
// enqueues a job in the idempotent call's own transaction, so the job
// exists if and only if the call committed, and a River worker charges the
// provider with the key stored in the job. River retries a job whose try
// failed or whose worker died; every try sends the same key, so the
// provider charges once.
package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
)

// ChargeArgs is the job: a ledger row the provider has still to charge.
type ChargeArgs struct {
	payments.ChargeJob
}

// Kind names the job for River.
func (ChargeArgs) Kind() string { return "payments_provider_charge" }

// Migrate creates River's tables in the connection's search_path.
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	m, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	_, err = m.Migrate(ctx, rivermigrate.DirectionUp, nil)
	return err
}

// Config configures an [Outbox].
type Config struct {
	// Provider charges the jobs. Nil makes an outbox that only enqueues: the
	// workers run elsewhere.
	Provider *provider.Client
	// Workers is how many jobs run at once. Defaults to 4.
	Workers int
	// RetryDelay is the wait before a failed try is tried again. Defaults
	// to 1 second.
	RetryDelay time.Duration
	// RescueAfter is how long a job may stay running before River takes it
	// for dead (its worker's process died) and runs it again. River looks
	// for such jobs once at its start and then every 30 seconds, on the
	// client that leads (a dead leader is replaced within 15 seconds).
	// Defaults to 1 minute.
	RescueAfter time.Duration
	// AfterProvider, when set, runs after the provider answered and before
	// the ledger row is settled: the point at which a dying worker loses
	// the provider's answer. The crash tests die there.
	AfterProvider func(ctx context.Context)
	// AfterSettle, when set, runs after the ledger row is settled and
	// before River records the job's completion: the point at which a
	// dying worker leaves a settled row behind a job that will run again.
	// The crash tests die there.
	AfterSettle func(ctx context.Context)
}

// Outbox enqueues provider charges in a call's transaction and, with a
// provider, works them.
type Outbox struct {
	client *river.Client[pgx.Tx]
	config *pgxpool.Config
	works  bool
}

// New returns an outbox on pool. Run [Migrate] first, and Start it to work
// jobs.
func New(pool *pgxpool.Pool, cfg Config) (*Outbox, error) {
	rc := &river.Config{}
	o := &Outbox{works: cfg.Provider != nil, config: pool.Config()}
	if o.works {
		workers := river.NewWorkers()
		w := &worker{pool: pool, cfg: cfg}
		if w.cfg.RetryDelay <= 0 {
			w.cfg.RetryDelay = time.Second
		}
		if err := river.AddWorkerSafely(workers, w); err != nil {
			return nil, err
		}
		rc.Workers = workers
		rc.Queues = map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: max(cmp.Or(cfg.Workers, 4), 1)}}
		rc.RescueStuckJobsAfter = cfg.RescueAfter
		if rc.RescueStuckJobsAfter <= 0 {
			rc.RescueStuckJobsAfter = time.Minute
		}
		rc.JobTimeout = min(rc.RescueStuckJobsAfter/2, 30*time.Second)
		rc.FetchPollInterval = 100 * time.Millisecond
	}
	client, err := river.NewClient(riverpgxv5.New(pool), rc)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	o.client = client
	return o, nil
}

// EnqueueCharge implements [payments.Outbox]: the job is inserted in tx.
func (o *Outbox) EnqueueCharge(ctx context.Context, tx pgx.Tx, job payments.ChargeJob) error {
	if job.ProviderKey == "" {
		return errors.New("outbox: the job has no provider key (is Charge running under an idempotency key?)")
	}
	_, err := o.client.InsertTx(ctx, configuredTx{Tx: tx, config: o.config}, ChargeArgs{ChargeJob: job}, nil)
	return err
}

// configuredTx answers River's pgx driver, which reads the query mode from
// a Config method when the value it is given has one, and otherwise from
// tx.Conn(). The idempotency engine must take a call of tx.Conn() for the
// handler taking the connection itself (which could end the transaction
// behind its back): it holds the key's lock for the session, closes the
// connection after the call, and keeps an error for the key if that
// connection is lost. Config keeps River off that path.
type configuredTx struct {
	pgx.Tx
	config *pgxpool.Config
}

func (t configuredTx) Config() *pgxpool.Config { return t.config }

// Start works jobs until Stop; it needs a provider.
func (o *Outbox) Start(ctx context.Context) error {
	if !o.works {
		return errors.New("outbox: no provider to work jobs with")
	}
	return o.client.Start(ctx)
}

// Stop waits for the jobs in progress, until ctx is done.
func (o *Outbox) Stop(ctx context.Context) error {
	if !o.works {
		return nil
	}
	return o.client.Stop(ctx)
}

type worker struct {
	river.WorkerDefaults[ChargeArgs]
	pool *pgxpool.Pool
	cfg  Config
}

// Work reads the job's ledger row, and unless it is already settled,
// charges the provider under the job's key, then settles the row. A try
// that fails where trying again can help is retried; one the provider
// refused for good is cancelled, so that it is never retried forever.
//
// The row comes first because a job runs again after its row was settled:
// a worker that dies after settling and before River records the
// completion leaves the job running, and River rescues it. The provider's
// key may have expired by then (River rescues after RescueAfter, and a
// job can wait for a worker much longer), and the provider would take
// the key as new and charge a second time.
func (w *worker) Work(ctx context.Context, job *river.Job[ChargeArgs]) error {
	a := job.Args
	row, err := payments.ReadLedger(ctx, w.pool, a.ChargeID)
	if err != nil {
		return err
	}
	if row.Settled() {
		return nil
	}
	if row.AccountID != a.AccountID || row.AmountCents != a.AmountCents {
		return fmt.Errorf("outbox: job %d charges %d cents to %s, but its ledger row %s is %d cents to %s; not charging the provider until they agree",
			job.ID, a.AmountCents, a.AccountID, a.ChargeID, row.AmountCents, row.AccountID)
	}
	ch, err := w.cfg.Provider.Charge(idempotency.WithOutgoingKey(ctx, a.ProviderKey), a.AccountID, a.AmountCents)
	if err != nil {
		if c := status.Code(err); c == codes.InvalidArgument || c == codes.FailedPrecondition {
			return river.JobCancel(err)
		}
		return err
	}
	if w.cfg.AfterProvider != nil {
		w.cfg.AfterProvider(ctx)
	}
	if err := payments.Settle(ctx, w.pool, a.ChargeID, ch.ID); err != nil {
		return err
	}
	if w.cfg.AfterSettle != nil {
		w.cfg.AfterSettle(ctx)
	}
	return nil
}

// NextRetry is the worker's own retry schedule: a fixed delay, instead of
// River's default that grows to hours.
func (w *worker) NextRetry(*river.Job[ChargeArgs]) time.Time {
	return time.Now().Add(w.cfg.RetryDelay)
}
