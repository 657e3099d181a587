// Package payments is an example service built on the idempotency library:
// a PaymentService whose Charge runs exactly once per idempotency key, with
// its ledger row and balance update committed in the same transaction as
// the stored response.
//
// The provider's charge of a call is a step of the call
// ([idempotency.Step], named [ProviderChargeEffect]): the provider's answer
// (its charge ID, or its decline) is recorded in a commit of its own the
// moment it arrives, outside the call's transaction, and a re-run of the
// call, or the outbox's job of it, takes that record instead of asking the
// provider again. So a charge is made once even when the provider has
// forgotten the key by the time the re-run comes (a crash before the
// call's commit, a job rescued hours later). What is left is a crash
// between the provider's answer and the step's commit: the re-run sends the
// same key again, and is charged once only if the provider still knows it.
// That window is one local commit long, not the provider's memory of keys.
//
// The binaries beside it: server (a standalone gRPC server), client (one
// charge through the retrying client interceptor) and demo (two replicas behind a
// faulty network, hundreds of charges, a verdict).
package payments

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	paymentsv1 "github.com/exactlyonce/idempotency/examples/payments/proto/payments/v1"
	"github.com/exactlyonce/idempotency/examples/payments/provider"
)

// Server implements paymentsv1.PaymentServiceServer on PostgreSQL.
type Server struct {
	paymentsv1.UnimplementedPaymentServiceServer
	pool          *pgxpool.Pool
	provider      *provider.Client
	outbox        Outbox
	afterProvider func(context.Context)
}

// Option configures a [Server].
type Option func(*Server)

// WithProvider makes Charge charge the payment provider through p, inside
// the call and before it writes the ledger row: the row names the
// provider's charge. The charge is the call's step [ProviderChargeEffect]
// ([ProviderChargeStep]): its request carries the step's key, derived from
// the call's, and the provider's answer is recorded as the step's outcome,
// committed at once on a connection of its own. A re-run of the call
// (after a crash before its commit, or a released key) takes the recorded
// charge and does not call the provider: one charge, even when the
// provider has forgotten the key by then.
func WithProvider(p *provider.Client) Option { return func(s *Server) { s.provider = p } }

// WithOutbox makes Charge leave the provider's charge to a worker: it
// enqueues the charge in the call's own transaction, so the job exists if
// and only if the call committed, with the key the worker must charge
// under.
func WithOutbox(o Outbox) Option { return func(s *Server) { s.outbox = o } }

// WithAfterProvider runs hook after the provider answered and its answer
// was recorded as the call's step, and before the ledger row is written
// and the call commits: the moment at which a crash loses the call's work
// but no longer the provider's answer. The demo and the crash tests die
// there.
func WithAfterProvider(hook func(context.Context)) Option {
	return func(s *Server) { s.afterProvider = hook }
}

// ProviderChargeEffect names the provider's charge of a call, for
// [idempotency.EffectKey] and [idempotency.Step]: one name, so one key and
// one step record, for the one charge a call makes, whichever way it is
// made and whatever else the handler calls.
const ProviderChargeEffect = "provider charge"

// ProviderChargeStep is the step that charges account amountCents at the
// provider p under the step's key, for [idempotency.Step] (inside a call)
// and [idempotency.KeyedStep] (the outbox's worker, under the job's key):
// one step, recorded under one key, whichever way it runs. Its outcome is
// the provider's charge ID; a decline ([provider.ErrDeclined]) is final,
// recorded like a charge, so a re-run gets the decline without asking the
// provider again. Other errors are recorded nowhere: the next try sends
// the same key. Read the outcome with [ProviderChargeOutcome].
func ProviderChargeStep(p *provider.Client, account string, amountCents int64) func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
	return func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
		ch, err := p.Charge(idempotency.WithOutgoingKey(ctx, key), account, amountCents)
		switch {
		case errors.Is(err, provider.ErrDeclined):
			return nil, idempotency.Final(err)
		case err != nil:
			return nil, err
		}
		return wrapperspb.String(ch.ID), nil
	}
}

// ProviderChargeOutcome reads the outcome of a [ProviderChargeStep]: the
// provider's charge ID, or the step's error. A recorded decline comes back
// as an error that matches [provider.ErrDeclined] with the decline's
// status (InvalidArgument) and is no longer marked final, so that a call
// returning it releases its key, as a decline always did: the client may
// correct the charge and send it again under its key (another request,
// so another step).
func ProviderChargeOutcome(v *wrapperspb.StringValue, err error) (string, error) {
	switch {
	case idempotency.IsFinal(err):
		return "", &recordedDecline{st: status.Convert(err)}
	case err != nil:
		return "", err
	case v.GetValue() == "":
		return "", status.Error(codes.Internal, "payments: the provider charge step recorded no charge ID")
	}
	return v.GetValue(), nil
}

// recordedDecline is a decline the provider charge step recorded.
type recordedDecline struct{ st *status.Status }

func (e *recordedDecline) Error() string              { return e.st.Message() }
func (e *recordedDecline) Is(target error) bool       { return target == provider.ErrDeclined }
func (e *recordedDecline) GRPCStatus() *status.Status { return e.st }

// Outbox takes charges for the provider in a call's transaction.
type Outbox interface {
	// EnqueueCharge writes job in tx; it commits or rolls back with it.
	EnqueueCharge(ctx context.Context, tx pgx.Tx, job ChargeJob) error
}

// ChargeJob is a charge the provider has still to make.
type ChargeJob struct {
	ChargeID    string `json:"charge_id"` // the ledger row's
	AccountID   string `json:"account_id"`
	AmountCents int64  `json:"amount_cents"`
	// ProviderKey is the idempotency key to charge the provider with, derived
	// from the call that enqueued the job; the worker sends it on every try.
	// It is also the key of the provider charge's step
	// ([idempotency.KeyedStep]): the record a run of the call that charged
	// inside itself made under [ProviderChargeEffect], or the worker's own.
	ProviderKey string `json:"provider_key"`
	// Scope is the idempotency scope of the call that enqueued the job
	// (idempotency.IncomingScope), the step's scope. Jobs enqueued before it was added
	// have none, which is the gRPC API's scope.
	Scope string `json:"scope,omitempty"`
}

// NewServer returns a PaymentService on pool. Run [Migrate] first. Without
// [WithProvider] or [WithOutbox] charges stay in the ledger.
func NewServer(pool *pgxpool.Pool, opts ...Option) *Server {
	s := &Server{pool: pool}
	for _, o := range opts {
		o(s)
	}
	return s
}

// Migrate creates the idempotency key table and the service's own tables.
func Migrate(ctx context.Context, pool *pgxpool.Pool, store *idempotency.Store) error {
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `
CREATE TABLE IF NOT EXISTS accounts (
    account_id    text PRIMARY KEY,
    balance_cents bigint NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS ledger (
    charge_id    text PRIMARY KEY,
    account_id   text NOT NULL REFERENCES accounts,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    created_at   timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE ledger ADD COLUMN IF NOT EXISTS provider_charge_id text UNIQUE;
ALTER TABLE ledger ADD COLUMN IF NOT EXISTS status text NOT NULL DEFAULT 'charged'
    CONSTRAINT ledger_status_check CHECK (status IN ('charged', 'declined'));
CREATE INDEX IF NOT EXISTS ledger_account_id_idx ON ledger (account_id);`)
	return err
}

// Charge records the charge and raises the account's balance, both through
// the idempotent call's transaction, and has the provider charge it: first,
// inside the call ([WithProvider]), or after the commit, by a worker
// ([WithOutbox]).
func (s *Server) Charge(ctx context.Context, req *paymentsv1.ChargeRequest) (*paymentsv1.ChargeResponse, error) {
	switch {
	case req.GetAccountId() == "":
		return nil, status.Error(codes.InvalidArgument, "account_id is required")
	case req.GetAmountCents() <= 0:
		return nil, status.Errorf(codes.InvalidArgument, "amount_cents must be positive, got %d", req.GetAmountCents())
	}
	tx := idempotency.MustTxFromContext(ctx)
	// One key for the provider's charge of this call, whichever way it is
	// made: a call whose first run charged the provider inside the call and
	// whose re-run enqueues the charge (a rolling switch to the outbox), or
	// the other way round, charges the provider once.
	var providerKey string
	if s.provider != nil || s.outbox != nil {
		var ok bool
		if providerKey, ok = idempotency.EffectKey(ctx, ProviderChargeEffect); !ok {
			return nil, status.Error(codes.Internal, "payments: Charge runs outside an idempotent call; serve it behind idempotency.UnaryServerInterceptor (NewGRPCServer does)")
		}
	}
	var providerCharge *string
	if s.provider != nil {
		// The step's key is providerKey (EffectKey of the same name). A
		// decline returns InvalidArgument, not final: the call's key is
		// released, and the step keeps the decline for a re-run of the same
		// request.
		id, err := ProviderChargeOutcome(idempotency.Step(ctx, ProviderChargeEffect, ProviderChargeStep(s.provider, req.GetAccountId(), req.GetAmountCents())))
		if err != nil {
			return nil, err
		}
		providerCharge = &id
		if s.afterProvider != nil {
			s.afterProvider(ctx)
		}
	}
	resp := &paymentsv1.ChargeResponse{
		ChargeId:    "ch_" + uuid.Must(uuid.NewV7()).String(),
		AccountId:   req.GetAccountId(),
		AmountCents: req.GetAmountCents(),
	}
	// One statement: raise the balance (the upsert locks the account row, so
	// charges to one account queue up) and insert the ledger row.
	err := tx.QueryRow(ctx, `
WITH account AS (
    INSERT INTO accounts (account_id, balance_cents) VALUES ($1, $2)
    ON CONFLICT (account_id) DO UPDATE SET balance_cents = accounts.balance_cents + EXCLUDED.balance_cents
    RETURNING balance_cents
), charge AS (
    INSERT INTO ledger (charge_id, account_id, amount_cents, provider_charge_id) VALUES ($3, $1, $2, $4)
)
SELECT balance_cents FROM account`, req.GetAccountId(), req.GetAmountCents(), resp.GetChargeId(), providerCharge).Scan(&resp.BalanceCents)
	if err != nil {
		return nil, fmt.Errorf("charge %s: %w", req.GetAccountId(), err)
	}
	if s.outbox != nil {
		job := ChargeJob{ChargeID: resp.GetChargeId(), AccountID: req.GetAccountId(), AmountCents: req.GetAmountCents(), ProviderKey: providerKey, Scope: callScope(ctx)}
		if err := s.outbox.EnqueueCharge(ctx, tx, job); err != nil {
			return nil, fmt.Errorf("enqueue the provider's charge: %w", err)
		}
	}
	return resp, nil
}

// The status of a ledger row: charged when the call committed it (its
// amount is in the account's balance), declined when the provider declined
// the outbox's charge of it afterwards ([Decline]: its amount was taken
// out of the balance again).
const (
	StatusCharged  = "charged"
	StatusDeclined = "declined"
)

// Errors of [Settle], [Decline] and [ReadLedger] that trying again does not
// mend, for [errors.Is]: the ledger row does not exist, or it is decided
// otherwise than the caller says (settled with another provider charge,
// settled when declined, declined when settled). A person must look.
var (
	ErrNoLedgerRow    = errors.New("no such ledger row")
	ErrLedgerConflict = errors.New("ledger conflict")
)

// Settle records, once, the provider's charge of a ledger row that the
// outbox's worker charged. Settling it again with the same charge is a
// no-op; with another, an error; settling a declined row is an error too.
func Settle(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, chargeID, providerChargeID string) error {
	var current *string
	var rowStatus string
	// The row lock orders two settlements of one row, and a settlement and
	// a decline: the second sees the first's outcome.
	err := db.QueryRow(ctx, `
UPDATE ledger SET provider_charge_id = CASE WHEN status = 'charged' THEN coalesce(provider_charge_id, $2) ELSE provider_charge_id END
WHERE charge_id = $1 RETURNING provider_charge_id, status`,
		chargeID, providerChargeID).Scan(&current, &rowStatus)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("settle %s: %w", chargeID, ErrNoLedgerRow)
	case err != nil:
		return fmt.Errorf("settle %s: %w", chargeID, err)
	case rowStatus != StatusCharged:
		return fmt.Errorf("settle %s: %w: the ledger row is %s and its amount was taken out of the balance, but the provider answered with charge %s: "+
			"refund %s at the provider, or charge the account again by hand", chargeID, ErrLedgerConflict, rowStatus, providerChargeID, providerChargeID)
	case *current != providerChargeID:
		return fmt.Errorf("settle %s: %w: the ledger names provider charge %s, the provider answered %s", chargeID, ErrLedgerConflict, *current, providerChargeID)
	}
	return nil
}

// Decline records that the provider declined the outbox's charge of the
// ledger row chargeID, in one transaction: the row is marked declined and
// its amount taken out of its account's balance. Declining a declined row
// again is a no-op; declining a settled row (one that names the provider's
// charge) is an error.
func Decline(ctx context.Context, db interface {
	Begin(context.Context) (pgx.Tx, error)
}, chargeID string) error {
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		var account, rowStatus string
		var amount int64
		var providerCharge *string
		// The row lock orders the decline after a settlement of the row,
		// and a second decline after the first.
		err := tx.QueryRow(ctx, `SELECT account_id, amount_cents, status, provider_charge_id FROM ledger WHERE charge_id = $1 FOR UPDATE`, chargeID).
			Scan(&account, &amount, &rowStatus, &providerCharge)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return ErrNoLedgerRow
		case err != nil:
			return err
		case providerCharge != nil:
			return fmt.Errorf("%w: the ledger row is settled with provider charge %s: a charge the provider made cannot be declined; refund it at the provider instead", ErrLedgerConflict, *providerCharge)
		case rowStatus == StatusDeclined:
			return nil
		}
		if _, err := tx.Exec(ctx, `UPDATE ledger SET status = 'declined' WHERE charge_id = $1`, chargeID); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, `UPDATE accounts SET balance_cents = balance_cents - $2 WHERE account_id = $1`, account, amount)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("its account %s has no row", account)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("decline %s: %w", chargeID, err)
	}
	return nil
}

// LedgerEntry is a ledger row as the outbox's worker reads it before it
// calls the provider.
type LedgerEntry struct {
	ChargeID    string
	AccountID   string
	AmountCents int64
	// Status is StatusCharged or StatusDeclined.
	Status string
	// ProviderChargeID is the provider's charge the row is settled with;
	// empty while the provider has not been charged (or its answer not
	// recorded).
	ProviderChargeID string
}

// Settled reports whether the row names its provider charge.
func (e LedgerEntry) Settled() bool { return e.ProviderChargeID != "" }

// Decided reports whether the provider's answer to the row is recorded:
// settled or declined. The outbox's worker does not call the provider for
// a decided row.
func (e LedgerEntry) Decided() bool { return e.Settled() || e.Status == StatusDeclined }

// ReadLedger reads the ledger row chargeID.
func ReadLedger(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, chargeID string) (LedgerEntry, error) {
	e := LedgerEntry{ChargeID: chargeID}
	var providerCharge *string
	err := db.QueryRow(ctx, `SELECT account_id, amount_cents, status, provider_charge_id FROM ledger WHERE charge_id = $1`, chargeID).
		Scan(&e.AccountID, &e.AmountCents, &e.Status, &providerCharge)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return e, fmt.Errorf("ledger row %s: %w (a job is committed with its row, so the row was deleted since)", chargeID, ErrNoLedgerRow)
	case err != nil:
		return e, fmt.Errorf("ledger row %s: %w", chargeID, err)
	}
	if providerCharge != nil {
		e.ProviderChargeID = *providerCharge
	}
	return e, nil
}

// GetBalance reads the account's balance, number of charges and number of
// declined charges.
func (s *Server) GetBalance(ctx context.Context, req *paymentsv1.GetBalanceRequest) (*paymentsv1.GetBalanceResponse, error) {
	if req.GetAccountId() == "" {
		return nil, status.Error(codes.InvalidArgument, "account_id is required")
	}
	t, err := ReadTotals(ctx, s.pool, req.GetAccountId())
	if err != nil {
		return nil, fmt.Errorf("balance %s: %w", req.GetAccountId(), err)
	}
	return &paymentsv1.GetBalanceResponse{AccountId: req.GetAccountId(), BalanceCents: t.BalanceCents, Charges: t.Charges, DeclinedCharges: t.DeclinedCharges}, nil
}

// NewGRPCServer returns a gRPC server with the idempotency interceptors and
// svc registered. The stream interceptor refuses streaming calls that carry
// a key, which the library does not protect (the service has none today).
func NewGRPCServer(svc *Server, store *idempotency.Store, opts ...idempotency.ServerOption) *grpc.Server {
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store, opts...)),
		grpc.ChainStreamInterceptor(idempotency.StreamServerInterceptor(store, opts...)),
	)
	paymentsv1.RegisterPaymentServiceServer(srv, svc)
	return srv
}

// Balance reads an account directly from the database, for checks: its
// balance and its charges, declined ones left out of both.
func Balance(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, account string) (balance, charges int64, err error) {
	t, err := ReadTotals(ctx, db, account)
	return t.BalanceCents, t.Charges, err
}

// Totals is an account as [ReadTotals] reads it.
type Totals struct {
	// BalanceCents is the sum of the account's charges, declined ones
	// taken out.
	BalanceCents int64
	// Charges counts the account's ledger rows not declined,
	// DeclinedCharges the declined ones.
	Charges, DeclinedCharges int64
}

// ReadTotals reads an account in one statement (one snapshot): an unknown
// account has zero totals.
func ReadTotals(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, account string) (Totals, error) {
	var t Totals
	err := db.QueryRow(ctx, `
SELECT coalesce((SELECT balance_cents FROM accounts WHERE account_id = $1), 0),
       count(*) FILTER (WHERE status <> 'declined'),
       count(*) FILTER (WHERE status = 'declined')
FROM ledger WHERE account_id = $1`, account).Scan(&t.BalanceCents, &t.Charges, &t.DeclinedCharges)
	return t, err
}

// callScope is the idempotency scope of the call running in ctx.
func callScope(ctx context.Context) string {
	scope, _ := idempotency.IncomingScope(ctx)
	return scope
}
