// Package provider is a small payment provider for the payments example:
// the system where the money really moves, outside the PaymentService's
// database transaction. Like a real provider (Stripe, Adyen) it honours
// the Idempotency-Key header, here with this library's own HTTP
// middleware, on tables of its own.
//
//	POST /v1/charges   {"account_id": "acct-1", "amount_cents": 250}
//	                -> {"id": "pch_...", "account_id": "acct-1", "amount_cents": 250}
//
// A charge above the provider's limit ([WithDeclineAbove]) is declined,
// as a card issuer declines one: 402 Payment Required with
// {"error": "card_declined", ...}, which the middleware stores like a
// charge, so sending the request again with its key declines it again.
//
// Requests name their merchant in the Provider-Merchant header, which
// scopes their keys (a real provider would take it from the API key).
// Under one key, two requests are the same when they ask for the same
// charge, whatever name the provider was reached by. The [Client] sends
// the charges; inside an idempotent call its keys are derived from the
// call's own, so a re-run of the call charges nothing new.
package provider

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
)

// MerchantHeader names the merchant a request is made for.
const MerchantHeader = "Provider-Merchant"

// KeyTable is the provider's own idempotency key table.
const KeyTable = "provider_idempotency_keys"

// Charge is a charge the provider made.
type Charge struct {
	ID          string `json:"id"`
	AccountID   string `json:"account_id"`
	AmountCents int64  `json:"amount_cents"`
}

// NewStore returns the provider's idempotency store, on its own key table.
func NewStore(pool *pgxpool.Pool, opts ...idempotency.StoreOption) (*idempotency.Store, error) {
	return idempotency.NewStore(pool, append([]idempotency.StoreOption{idempotency.WithTable("", KeyTable)}, opts...)...)
}

// Migrate creates the provider's key table and its charges table.
func Migrate(ctx context.Context, pool *pgxpool.Pool, store *idempotency.Store) error {
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	_, err := pool.Exec(ctx, `
CREATE TABLE IF NOT EXISTS provider_charges (
    id           text PRIMARY KEY,
    merchant     text NOT NULL,
    account_id   text NOT NULL,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    created_at   timestamptz NOT NULL DEFAULT now()
)`)
	return err
}

// DefaultDeclineAbove is the largest charge, in cents, the provider makes
// unless [WithDeclineAbove] says otherwise.
const DefaultDeclineAbove = 1_000_000

// HandlerOption configures [NewHandler].
type HandlerOption func(*handler)

// WithDeclineAbove makes the provider decline every charge of more than
// cents. Defaults to [DefaultDeclineAbove].
func WithDeclineAbove(cents int64) HandlerOption {
	return func(h *handler) { h.declineAbove = cents }
}

// WithKeyTTL makes the provider forget each key ttl after it first saw
// it: a request sent again with the key later is a new one, and charges
// again. Real providers forget keys too (Stripe after 24 hours, the
// library's default here); the demo makes it a few seconds, to show that
// the PaymentService charges once all the same, as it keeps the provider's
// answers itself (idempotency.Step).
func WithKeyTTL(ttl time.Duration) HandlerOption {
	return func(h *handler) { h.keyTTL = ttl }
}

// DeclineCode is the error of a declined charge's answer.
const DeclineCode = "card_declined"

type handler struct {
	declineAbove int64
	keyTTL       time.Duration // 0: the library's default
}

// NewHandler serves the provider's API, its charges deduplicated by store.
func NewHandler(store *idempotency.Store, opts ...HandlerOption) http.Handler {
	h := &handler{declineAbove: DefaultDeclineAbove}
	for _, o := range opts {
		o(h)
	}
	mux := http.NewServeMux()
	scope := idempotency.WithHTTPScope(func(r *http.Request) (string, error) {
		if m := r.Header.Get(MerchantHeader); m != "" {
			return m, nil
		}
		return "", status.Errorf(codes.Unauthenticated, "the %s header is required", MerchantHeader)
	})
	mwOpts := []idempotency.HTTPOption{scope}
	if h.keyTTL > 0 {
		mwOpts = append(mwOpts, idempotency.WithHTTPTTL(h.keyTTL))
	}
	mux.Handle("POST /v1/charges", anyHost(idempotency.HTTPMiddleware(store, mwOpts...)(http.HandlerFunc(h.charge))))
	return mux
}

// anyHost serves next with the request's host taken out, so that the
// middleware compares a key's requests by what they ask for (method,
// path, merchant, body) and not by the name the provider was reached by,
// as a real provider compares a key's parameters and not the URL's host.
// A service that comes back by another name is sending the same charge:
// restarted with its provider on a fresh port, or a replica that names the
// provider localhost where another says 127.0.0.1.
func anyHost(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r = r.WithContext(r.Context()) // a copy: the server's request is left as it came
		r.Host = ""
		next.ServeHTTP(w, r)
	})
}

func (h *handler) charge(w http.ResponseWriter, r *http.Request) {
	var req Charge
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<16)).Decode(&req); err != nil {
		http.Error(w, "request body: "+err.Error(), http.StatusBadRequest)
		return
	}
	if req.AccountID == "" || req.AmountCents <= 0 {
		http.Error(w, "account_id and a positive amount_cents are required", http.StatusBadRequest)
		return
	}
	if req.AmountCents > h.declineAbove {
		// 402 is stored by the middleware (DefaultFinalStatus), as a
		// provider stores its declines: the key's answer is decided.
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusPaymentRequired)
		_ = json.NewEncoder(w).Encode(map[string]string{
			"error":   DeclineCode,
			"message": fmt.Sprintf("the charge of %d cents is above the limit of %d cents", req.AmountCents, h.declineAbove),
		})
		return
	}
	c := Charge{ID: "pch_" + uuid.Must(uuid.NewV7()).String(), AccountID: req.AccountID, AmountCents: req.AmountCents}
	tx := idempotency.MustTxFromContext(r.Context())
	if _, err := tx.Exec(r.Context(), `INSERT INTO provider_charges (id, merchant, account_id, amount_cents) VALUES ($1, $2, $3, $4)`,
		c.ID, r.Header.Get(MerchantHeader), c.AccountID, c.AmountCents); err != nil {
		http.Error(w, "charge: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(c)
}

// Client charges through the provider's API.
type Client struct {
	// BaseURL is the provider's address, e.g. "http://127.0.0.1:8090".
	BaseURL string
	// Merchant is sent in the Provider-Merchant header.
	Merchant string
	// HTTP sends each attempt; nil means http.DefaultTransport with a 10
	// second timeout. The key is set before the first attempt, whatever
	// its transport.
	HTTP *http.Client
}

var defaultHTTP = &http.Client{Timeout: 10 * time.Second}

// ErrDeclined is the error, for [errors.Is], of a charge the provider
// declined (402, card_declined): no money moved, and sending the charge
// again with its key gets the same answer. Its gRPC status is
// InvalidArgument, which the idempotency library does not store by
// default: a call that charged inside itself and was declined releases
// its key.
var ErrDeclined = errors.New("provider declined the charge")

type declinedError struct{ answer []byte }

func (e *declinedError) Error() string {
	return fmt.Sprintf("%v (402: %s); no money moved, and sending it again with its key gets the same answer", ErrDeclined, bytes.TrimSpace(e.answer))
}

func (e *declinedError) Is(target error) bool { return target == ErrDeclined }

func (e *declinedError) GRPCStatus() *status.Status {
	return status.New(codes.InvalidArgument, e.Error())
}

// Charge charges account, through an idempotency.HTTPClient: the request
// carries one Idempotency-Key (from idempotency.WithOutgoingKey in ctx,
// derived inside an idempotent call, or generated), kept across its three
// attempts at most, so sending it again, from a retry here, a re-run of
// the call or a worker's retry, returns the first charge instead of making
// another.
//
// Errors are gRPC status errors: Unavailable when trying again with the
// same key can help (the provider could not be reached, failed, or is
// still busy with the key), InvalidArgument when it refused the request
// ([ErrDeclined] when it declined the charge), and Internal when this
// side is at fault: BaseURL does not parse, or the provider refused the
// key (422) because it holds another request under it.
//
// That refusal is never the customer's: a key is one charge's (derived
// from the call, or given for one charge), so this side sent other bytes
// for the same charge, after a change of its configuration between two
// runs of the charge (a path in BaseURL, the request's encoding in a
// deploy) or because of a bug. The provider may have made the first
// charge, so the error is not one an idempotent call stores as its answer:
// the call's key is released, and its re-run, once the change is undone,
// gets the first charge back. An operator looks the key up at the
// provider, then undoes the change, or settles or refunds the charge by
// hand.
func (c *Client) Charge(ctx context.Context, account string, amountCents int64) (Charge, error) {
	body, err := json.Marshal(Charge{AccountID: account, AmountCents: amountCents})
	if err != nil {
		return Charge{}, err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimSuffix(c.BaseURL, "/")+"/v1/charges", strings.NewReader(string(body)))
	if err != nil {
		return Charge{}, status.Errorf(codes.Internal, "provider URL %q: %v; correct the provider's URL", c.BaseURL, err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(MerchantHeader, c.Merchant)
	hc := c.HTTP
	if hc == nil {
		hc = defaultHTTP
	}
	// One key for the charge, kept across the retries of a lost
	// connection, a 5xx, or the provider's 409 while it still runs the
	// key's first request: a retry is the same charge, never a second.
	resp, err := (&idempotency.HTTPClient{Client: hc, MaxAttempts: 3, Budget: 10 * time.Second}).Do(req)
	if err != nil {
		switch {
		case errors.Is(err, idempotency.ErrInvalidKey):
			return Charge{}, status.Errorf(codes.InvalidArgument, "provider charge: %v", err)
		case errors.Is(err, idempotency.ErrCallEnded):
			return Charge{}, status.Errorf(codes.Internal, "provider charge: %v", err)
		}
		return Charge{}, status.Errorf(codes.Unavailable, "provider charge: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return Charge{}, status.Errorf(codes.Unavailable, "provider charge: reading the answer: %v", err)
	}
	switch {
	case resp.StatusCode == http.StatusOK:
	case resp.StatusCode == http.StatusPaymentRequired:
		return Charge{}, &declinedError{answer: b}
	case resp.StatusCode == http.StatusUnprocessableEntity:
		return Charge{}, status.Errorf(codes.Internal, "provider refused idempotency key %s, which it holds for another request (%s): "+
			"this service sent other bytes for the same charge, after a change of its configuration or by a bug, and the provider may have made the first charge; "+
			"look the key up at the provider, then undo the change (the charge sent again then gets its first answer) or settle it by hand",
			resp.Request.Header.Get(idempotency.HeaderKey), bytes.TrimSpace(b))
	case resp.StatusCode == http.StatusConflict, resp.StatusCode == http.StatusTooManyRequests, resp.StatusCode >= 500:
		return Charge{}, status.Errorf(codes.Unavailable, "provider answered %d: %s", resp.StatusCode, b)
	default:
		return Charge{}, status.Errorf(codes.InvalidArgument, "provider answered %d: %s", resp.StatusCode, b)
	}
	var ch Charge
	if err := json.Unmarshal(b, &ch); err != nil || ch.ID == "" || ch.AccountID != account || ch.AmountCents != amountCents {
		return Charge{}, status.Errorf(codes.Internal, "provider answered 200 with %q, not the charge asked for (%v)", b, err)
	}
	return ch, nil
}
