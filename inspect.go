package idempotency

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// ErrKeyNotFound is returned by [Store.Inspect] and [Store.Forget] for a key
// that has no record (never used, released, or deleted by the cleaner).
var ErrKeyNotFound = errors.New("idempotency: no record of this key")

// Record is what a store keeps of one key, for operators: [Store.Inspect].
type Record struct {
	Scope, Key string
	// Method is the operation the key was used for: the gRPC full method,
	// "POST /path" for HTTP, "idempotency/message" for a message.
	Method string
	// State is "succeeded" (Response holds the result) or "failed" (Status
	// holds the final error).
	State string
	// CreatedAt is when the result was stored, ExpiresAt when the key
	// expires; Expired says whether it already has (the cleaner has not
	// deleted it yet).
	CreatedAt, ExpiresAt time.Time
	Expired              bool
	// ResponseType is the stored response's protobuf message name, "" when
	// there is none; Response its encoding. An HTTP response is a
	// google.protobuf.BytesValue holding the body.
	ResponseType string
	Response     []byte
	// Status is the final error of a failed call.
	Status *status.Status
	// Fingerprint identifies the request the key was first used with.
	Fingerprint []byte
}

// Inspect returns the record of one key.
func (s *Store) Inspect(ctx context.Context, scope, key string) (Record, error) {
	rec := Record{Scope: scope, Key: key}
	var responseType *string
	var st []byte
	err := s.db.QueryRow(ctx, s.sql.inspect, scope, key).Scan(&rec.Method, &rec.State, &rec.CreatedAt, &rec.ExpiresAt, &rec.Expired,
		&responseType, &rec.Response, &st, &rec.Fingerprint)
	if errors.Is(err, pgx.ErrNoRows) {
		return rec, ErrKeyNotFound
	}
	if err != nil {
		return rec, fmt.Errorf("idempotency: inspect key: %w", err)
	}
	if responseType != nil {
		rec.ResponseType = *responseType
	}
	if st != nil {
		p := &statuspb.Status{}
		if err := proto.Unmarshal(st, p); err != nil {
			return rec, fmt.Errorf("idempotency: inspect key: stored status: %w", err)
		}
		rec.Status = status.FromProto(p)
	}
	return rec, nil
}

// Forget deletes the record of one key, so that the next call with it runs
// again: for an operator who knows the stored result must not be replayed
// (a customer's charge that was refunded by hand, say). It refuses, with
// [ErrInProgress], while a call holds the key, and returns
// [ErrKeyNotFound] when there is no record.
func (s *Store) Forget(ctx context.Context, scope, key string) error {
	tx, err := s.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("idempotency: forget key: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	var locked bool
	if err := tx.QueryRow(ctx, s.sql.lock, scope, key).Scan(&locked, new(time.Time)); err != nil {
		return fmt.Errorf("idempotency: forget key: %w", err)
	}
	if !locked {
		return inProgress("a call holds the key; forget it once the call is over", s.opts.retryDelay)
	}
	tag, err := tx.Exec(ctx, s.sql.forget, scope, key)
	if err != nil {
		return fmt.Errorf("idempotency: forget key: %w", err)
	}
	if tag.RowsAffected() == 0 {
		return ErrKeyNotFound
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("idempotency: forget key: %w", err)
	}
	return nil
}
