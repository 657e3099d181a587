// Package outbox is the asynchronous way for the payments example to reach
// its provider: a transactional outbox on River (riverqueue.com). Charge
// enqueues a job in the idempotent call's own transaction, so the job
// exists if and only if the call committed, and a River worker charges the
// provider with the key stored in the job. A job whose try failed or
// whose worker died is tried again, with backoff, until it succeeds; every
// try sends the same key, and the worker reads the ledger row before it
// calls the provider, so the provider charges once.
//
// The worker charges as a step ([idempotency.KeyedStep], under the job's
// key and its call's scope): the provider's answer is recorded in a commit
// of its own as soon as it arrives, before the ledger row is settled. A job
// whose answer was lost (its worker died after the provider answered) and
// that is tried again takes the recorded answer and does not call the
// provider, however long it waited and whatever the provider still
// remembers of the key. It is the same record as the call's own step
// ([payments.ProviderChargeEffect]), so a charge made inside one run of a
// call and enqueued by another is made once.
//
// Two things it cannot do for you. A worker that dies between the
// provider's answer and the step's commit (one local commit) leaves no
// record: the job's next try sends the same key again, and is charged once
// only if the provider still knows the key, so its key lifetime (24 hours
// for Stripe, the library's default) must still exceed how long a job can
// wait for its next try; FailingCharges shows the jobs that approach it.
// And River's stuck-job rescuer runs on the client that leads in the
// database: a River client of another service on the same River tables,
// without this worker, discards a rescued charge job as a kind it does not
// know. Give the outbox River tables of its own (a schema in the pool's
// search_path), or register this worker on every River client there.
package outbox

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"runtime/debug"
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

// InsertOpts gives the job the most attempts River's column holds; the
// worker's failed (outbox.go) explains why the job is never discarded.
func (ChargeArgs) InsertOpts() river.InsertOpts { return river.InsertOpts{MaxAttempts: math.MaxInt16} }

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
	// Store records the provider's answers as steps
	// ([idempotency.KeyedStep]); required with a Provider. It must be the
	// store the PaymentService's calls run on (its table), so that a job's
	// step is the one the call's charge recorded.
	Store *idempotency.Store
	// StepTTL is how long the record of a job's provider charge is kept,
	// when the job's call did not record it first (its own is the call's
	// TTL). Defaults to idempotency.DefaultTTL. A job tried again after
	// its record expired asks the provider again.
	StepTTL time.Duration
	// Workers is how many jobs run at once. Defaults to 4.
	Workers int
	// RetryBase is the wait before a job whose try failed is tried again,
	// the first time; each further failure doubles it, up to RetryCap.
	// Every wait is jittered, to between half of it and all of it, so that
	// the jobs of one outage do not come back together. Defaults to 1
	// second (or RetryDelay).
	RetryBase time.Duration
	// RetryCap is the longest wait between two tries of a job. A job is
	// tried until it succeeds: through an outage of any length, the
	// provider sees each waiting job about once per RetryCap. Defaults to
	// 5 minutes (or RetryDelay).
	RetryCap time.Duration
	// RetryDelay, when set, is a fixed wait between tries (jittered like
	// the others): it stands for RetryBase and RetryCap where they are not
	// set.
	RetryDelay time.Duration
	// WarnAfter is how many failed tries of one job make the worker log it
	// at Warn, and again each time the number doubles; the tries before
	// are logged at Debug. Defaults to 10. [Outbox.FailingCharges] lists
	// such jobs.
	WarnAfter int
	// Logger receives the worker's lines, and River's. Defaults to
	// slog.Default() for the worker's and River's own default for River's.
	Logger *slog.Logger
	// RescueAfter is how long a job may stay running before River takes it
	// for dead (its worker's process died) and runs it again. River looks
	// for such jobs once at its start and then every 30 seconds, on the
	// client that leads (a dead leader is replaced within 15 seconds).
	// Defaults to 1 minute.
	RescueAfter time.Duration
	// AfterProvider, when set, runs after the provider answered and its
	// answer was recorded as the job's step, and before the ledger row is
	// settled: the point at which a dying worker leaves an unsettled row
	// whose charge is recorded. The crash tests die there.
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
	works  bool
}

// New returns an outbox on pool. Run [Migrate] first, and Start it to work
// jobs.
func New(pool *pgxpool.Pool, cfg Config) (*Outbox, error) {
	rc := &river.Config{Logger: cfg.Logger}
	o := &Outbox{works: cfg.Provider != nil}
	if o.works {
		if cfg.Store == nil {
			return nil, errors.New("outbox: Config.Store is required with a Provider: the worker records the provider's answers in it")
		}
		workers := river.NewWorkers()
		w := &worker{pool: pool, cfg: cfg}
		if w.cfg.RetryDelay > 0 {
			w.cfg.RetryBase = cmp.Or(max(w.cfg.RetryBase, 0), w.cfg.RetryDelay)
			w.cfg.RetryCap = cmp.Or(max(w.cfg.RetryCap, 0), w.cfg.RetryDelay)
		}
		if w.cfg.RetryBase <= 0 {
			w.cfg.RetryBase = time.Second
		}
		if w.cfg.RetryCap <= 0 {
			w.cfg.RetryCap = 5 * time.Minute
		}
		if w.cfg.RetryBase > w.cfg.RetryCap {
			return nil, fmt.Errorf("outbox: RetryBase (%v) is longer than RetryCap (%v), the longest wait between two tries; lower RetryBase or raise RetryCap", w.cfg.RetryBase, w.cfg.RetryCap)
		}
		if w.cfg.WarnAfter <= 0 {
			w.cfg.WarnAfter = 10
		}
		if w.cfg.Logger == nil {
			w.cfg.Logger = slog.Default()
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
	// tx is the call's transaction as the handler has it: River's driver
	// reads its settings from its Config method, never taking the
	// connection (see idempotency.TxFromContext).
	_, err := o.client.InsertTx(ctx, tx, ChargeArgs{ChargeJob: job}, nil)
	return err
}

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

// Work reads the job's ledger row, and unless it is already decided
// (settled or declined), charges the provider under the job's key as a
// step (or takes the answer the step recorded: see the package comment),
// then settles the row, or, when the provider declined the charge, marks
// the row declined and takes its amount out of the balance
// ([payments.Decline]).
//
// The row comes first because a job runs again after its row was settled:
// a worker that dies after settling and before River records the
// completion leaves the job running, and River rescues it. The step's
// record would answer it, but only while it is kept (StepTTL, or the
// call's TTL), and a job can wait for a worker much longer; a settled row
// answers it for good.
//
// A try that fails, whatever the failure, is tried again later (see
// [worker.failed]): the call that enqueued the job told its client the
// charge was taken, and a job given up on would leave the ledger charged
// and the provider not.
func (w *worker) Work(ctx context.Context, job *river.Job[ChargeArgs]) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = w.failed(ctx, job, fmt.Errorf("outbox: the worker panicked: %v\n%s", p, debug.Stack()))
		}
	}()
	err = w.charge(ctx, job)
	switch {
	case err == nil:
		return nil
	case errors.Is(ctx.Err(), context.Canceled):
		// The client is stopping (or the job was cancelled by hand): River
		// puts the job back without counting the try.
		return fmt.Errorf("%w: %w", ctx.Err(), err)
	}
	return w.failed(ctx, job, err)
}

// needsOperator marks an error that trying again does not mend until a
// person changes something: the provider refused the request, or the
// ledger disagrees with the job or with the provider. The job is still
// tried again (the person may fix the cause), and logged at Error.
type needsOperator struct{ error }

func (e needsOperator) Unwrap() error { return e.error }

func (w *worker) charge(ctx context.Context, job *river.Job[ChargeArgs]) error {
	a := job.Args
	row, err := payments.ReadLedger(ctx, w.pool, a.ChargeID)
	if errors.Is(err, payments.ErrNoLedgerRow) {
		return needsOperator{err}
	}
	if err != nil {
		return err
	}
	if row.Decided() {
		return nil
	}
	if row.AccountID != a.AccountID || row.AmountCents != a.AmountCents {
		return needsOperator{fmt.Errorf("outbox: job %d charges %d cents to %s, but its ledger row %s is %d cents to %s; not charging the provider until they agree",
			job.ID, a.AmountCents, a.AccountID, a.ChargeID, row.AmountCents, row.AccountID)}
	}
	// The step's record, when there is one (an earlier try's, or the
	// call's own inside its run), answers without the provider.
	providerCharge, err := payments.ProviderChargeOutcome(idempotency.KeyedStep(ctx, w.cfg.Store, a.Scope, a.ProviderKey, w.cfg.StepTTL,
		payments.ProviderChargeStep(w.cfg.Provider, a.AccountID, a.AmountCents)))
	if errors.Is(err, provider.ErrDeclined) {
		// The call that enqueued the job raised the balance; the decline
		// takes the amount out again, with the row marked, in one
		// transaction. The job is then done: trying again under its key
		// gets the same decline.
		if derr := payments.Decline(ctx, w.pool, a.ChargeID); derr != nil {
			return ledgerError(derr)
		}
		w.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "outbox: the provider declined the charge; the ledger row is marked declined and its amount taken out of the account's balance (the client was told the charge was taken)",
			slog.Int64("job_id", job.ID),
			slog.String("charge_id", a.ChargeID),
			slog.String("account_id", a.AccountID),
			slog.Int64("amount_cents", a.AmountCents),
			slog.String("error", err.Error()))
		return nil
	}
	if c := status.Code(err); c == codes.InvalidArgument || c == codes.FailedPrecondition || c == codes.Internal {
		return needsOperator{err}
	}
	if err != nil {
		return err
	}
	if w.cfg.AfterProvider != nil {
		w.cfg.AfterProvider(ctx)
	}
	if err := payments.Settle(ctx, w.pool, a.ChargeID, providerCharge); err != nil {
		return ledgerError(err)
	}
	if w.cfg.AfterSettle != nil {
		w.cfg.AfterSettle(ctx)
	}
	return nil
}

// ledgerError marks the ledger's refusals as needing a person; a database
// that failed is tried again like the provider.
func ledgerError(err error) error {
	if errors.Is(err, payments.ErrLedgerConflict) || errors.Is(err, payments.ErrNoLedgerRow) {
		return needsOperator{err}
	}
	return err
}

// failuresKey names the job's metadata that [worker.failed] keeps.
const failuresKey = "outbox_failures"

// failures is the job's record of its failed tries.
type failures struct {
	Count        int       `json:"count"`
	LastError    string    `json:"last_error"`
	LastFailedAt time.Time `json:"last_failed_at"`
}

func readFailures(metadata []byte) failures {
	var m struct {
		F failures `json:"outbox_failures"`
	}
	_ = json.Unmarshal(metadata, &m) // River's own JSON; a job without the key has none
	return m.F
}

// failed records the failed try in the job's metadata, logs it, and
// snoozes the job for the backoff, so that the job is never discarded.
//
// River discards a job whose try returns an
// error when the try's attempt number has reached the job's MaxAttempts
// (25 by default: with a 1 second delay, a 30 second outage), and its
// rescuer discards a stuck job at that attempt too. The attempt number
// grows by one each time a worker takes the job, and goes back down by one
// when the try ends in [river.JobSnooze]. So a failed try does not return
// its error to River: failed records the failure in the job's metadata
// (failuresKey: the count, the last error and when) and snoozes the job
// for the backoff. Failures then never bring the job nearer its
// MaxAttempts; only a worker that dies in the middle of a try does (its
// attempt is not given back), and jobs are inserted with the largest
// MaxAttempts River's smallint column holds, 32767 dead workers away.
// Jobs inserted before, with River's 25, are as safe from failures.
func (w *worker) failed(ctx context.Context, job *river.Job[ChargeArgs], cause error) error {
	f := readFailures(job.Metadata)
	f.Count++
	f.LastError = cause.Error()
	if len(f.LastError) > maxErrorBytes {
		f.LastError = f.LastError[:maxErrorBytes] + "...(truncated)"
	}
	f.LastFailedAt = time.Now().UTC()
	if err := river.MetadataSet(ctx, failuresKey, f); err != nil {
		// Only outside a worker; the count is then lost, the job is not.
		w.cfg.Logger.ErrorContext(ctx, "outbox: recording the failed try", slog.Int64("job_id", job.ID), slog.String("error", err.Error()))
	}
	delay := backoff(w.cfg.RetryBase, w.cfg.RetryCap, f.Count)

	level, msg := slog.LevelDebug, "outbox: the provider has not charged the job yet; trying again"
	switch {
	case errors.As(cause, new(needsOperator)):
		level, msg = slog.LevelError, "outbox: the job's charge cannot go through until the cause (the error) is fixed: the provider refused it, or the ledger disagrees; the job is tried again"
	case f.Count >= w.cfg.WarnAfter && f.Count%w.cfg.WarnAfter == 0 && isPowerOfTwo(f.Count/w.cfg.WarnAfter):
		level, msg = slog.LevelWarn, "outbox: the provider has not charged the job after many tries; it stays in the ledger, not charged, and is tried again (Outbox.FailingCharges lists such jobs)"
	}
	w.cfg.Logger.LogAttrs(ctx, level, msg,
		slog.Int64("job_id", job.ID),
		slog.String("charge_id", job.Args.ChargeID),
		slog.String("account_id", job.Args.AccountID),
		slog.Int64("amount_cents", job.Args.AmountCents),
		slog.Int("failures", f.Count),
		slog.Duration("next_try_in", delay),
		slog.String("error", f.LastError))
	return river.JobSnooze(delay)
}

// maxErrorBytes bounds the error kept in a job's metadata.
const maxErrorBytes = 2000

func isPowerOfTwo(n int) bool { return n > 0 && n&(n-1) == 0 }

// backoff is the wait after the job's failures-th failed try: base doubled
// for each failure after the first, at most limit, and jittered to between
// half of that and all of it.
func backoff(base, limit time.Duration, failures int) time.Duration {
	d := limit
	if n := failures - 1; n >= 0 && n < 62 && base <= limit>>n {
		d = base << n
	}
	return d/2 + rand.N(d-d/2+1)
}

// NextRetry is the wait River uses when a try ends other than by
// [worker.failed]'s snooze: a job whose worker died, rescued by River (each
// rescue is in the job's errors), or a job whose arguments did not decode.
func (w *worker) NextRetry(job *river.Job[ChargeArgs]) time.Time {
	return time.Now().Add(backoff(w.cfg.RetryBase, w.cfg.RetryCap, readFailures(job.Metadata).Count+len(job.Errors)))
}

// FailingCharge is a charge whose job keeps failing, as
// [Outbox.FailingCharges] lists it.
type FailingCharge struct {
	JobID       int64
	ChargeID    string // the ledger row's
	AccountID   string
	AmountCents int64
	// State is the job's River state: running while a worker tries it,
	// else waiting (available, scheduled or retryable) for its next try
	// at NextTryAt.
	State     string
	NextTryAt time.Time
	// Failures is how many of the job's tries failed, LastError the error
	// of the last one, at LastFailedAt.
	Failures     int
	LastError    string
	LastFailedAt time.Time
}

// FailingCharges lists the charges whose jobs are not done and have failed
// minFailures times or more (at least once), oldest job first: what the
// provider has not charged although the ledger has, and why. A charge
// leaves the list when its job succeeds.
func (o *Outbox) FailingCharges(ctx context.Context, minFailures int) ([]FailingCharge, error) {
	params := river.NewJobListParams().
		Kinds(ChargeArgs{}.Kind()).
		States("available", "pending", "retryable", "running", "scheduled").
		// A try that failed records itself in the job's metadata; a worker
		// that died mid-try cannot, and River records its rescue in the
		// job's errors: both count.
		Where("coalesce((metadata->'"+failuresKey+"'->>'count')::int, 0) + coalesce(array_length(errors, 1), 0) >= @min_failures", river.NamedArgs{"min_failures": max(minFailures, 1)}).
		OrderBy(river.JobListOrderByID, river.SortOrderAsc).
		First(1000)
	var list []FailingCharge
	for {
		res, err := o.client.JobList(ctx, params)
		if err != nil {
			return nil, fmt.Errorf("outbox: listing failing jobs: %w", err)
		}
		for _, j := range res.Jobs {
			var a ChargeArgs
			if err := json.Unmarshal(j.EncodedArgs, &a); err != nil {
				return nil, fmt.Errorf("outbox: job %d: its arguments do not decode as a charge: %w", j.ID, err)
			}
			f := readFailures(j.Metadata)
			if n := len(j.Errors); n > 0 {
				if last := j.Errors[n-1]; last.At.After(f.LastFailedAt) {
					f.LastError, f.LastFailedAt = last.Error, last.At
				}
				f.Count += n
			}
			list = append(list, FailingCharge{
				JobID: j.ID, ChargeID: a.ChargeID, AccountID: a.AccountID, AmountCents: a.AmountCents,
				State: string(j.State), NextTryAt: j.ScheduledAt,
				Failures: f.Count, LastError: f.LastError, LastFailedAt: f.LastFailedAt,
			})
		}
		if len(res.Jobs) < 1000 {
			return list, nil
		}
		params = params.After(res.LastCursor)
	}
}
